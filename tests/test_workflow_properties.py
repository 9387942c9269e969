"""A stateful property test of workflows: random graphs, claims, outcomes and cancels against a model of the docs.

Hypothesis declares random workflows (up to six steps, each after any of
the earlier ones, each dependency with its own policy, steps on two
queues), then drives claims, acks, dead letters, batches of acks with the
worker's claim in their transaction (`Claiming.ack_then_claim`), expiry
of queued steps (the reaper's batches), cancels of queued steps and of
whole workflows, and replays of failed steps. A
plain Python model of docs/workflows.md ("The model", "Policies",
"Status, cancel, replay") says what each step makes of the graph, and
after every step the database must agree:

- each step is in the state the model says (waiting, enqueued, acked,
  dead, expired, cancelled), with the reason naming the dependency that
  doomed it;
- a step's message exists exactly while the step is enqueued, and no step
  was ever enqueued twice but by a replay;
- each workflow's open and failed counts, state and outcome match;
- a claim takes only ready steps' messages, as many as it may; the claim in
  acks claims only when those acks released a step on its queues, and
  then as a claim would.

The model settles a batch's steps in waves, as the join does: a child that
one parent of the batch lets go and another dooms is doomed, with the
smallest (origin, reason) of those that doom it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
from django.utils import timezone
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import django_dbqueue
from django_dbqueue import Dep, Workflow, control
from django_dbqueue.models import (
    ArchivedMessage,
    Message,
    WorkflowEdge,
    WorkflowRun,
    WorkflowStep,
)
from tests.support.doc_models import RunModel, Settled, doom, propagate, settle_runs
from tests.support.machines import Profiles, run_machine

pytestmark = pytest.mark.django_db(transaction=True)

QUEUES = ["wp-a", "wp-b"]  # plain queues: the claim in acks is made only where no flow rule applies
WORKER = "wp-worker"
POLICIES = [
    frozenset(),
    frozenset({"dead"}),
    frozenset({"cancelled"}),
    frozenset({"expired"}),
    frozenset({"dead", "cancelled"}),
    frozenset({"dead", "cancelled", "expired"}),
]
SETTLED = ("acked", "dead", "expired", "cancelled")

PROFILES: Profiles = {
    # name: (max_examples, stateful_step_count) per database vendor
    "ci": {"sqlite": (30, 40), "mysql": (20, 40), "postgresql": (20, 40)},
    "long": {"sqlite": (200, 50), "mysql": (200, 50), "postgresql": (200, 50)},
}


@dataclass
class StepModel:
    name: str
    queue: str
    parents: dict[str, frozenset[str]]  # parent -> the outcomes this step tolerates besides acked
    children: list[str] = field(default_factory=list)
    state: str = "waiting"
    pending: int = 0
    cause: str | None = None
    reason: str = ""
    message_id: int | None = None
    enqueued: int = 0  # how many times it was enqueued (a replay enqueues it again)
    key: str | None = None  # its message's key (unique while live, per queue)
    holder: StepModel | None = None  # the step whose live message held its key when it became ready


def cancel_doomed(step: StepModel, origin: str, reason: str) -> None:
    """A step its dependency's end cancels, with the reason the docs give."""
    step.state, step.cause, step.reason = "cancelled", origin, reason


# Keys that differ only in case are two keys (docs/design.md, decision 9).
keys = st.sampled_from([None, None, None, "k", "K"])


@st.composite
def graphs(draw):
    """Steps ``s0``..``sN`` in dependency order (each after a random set of lower-numbered steps, each edge with
    a policy, on a queue, maybe keyed), and the order they are declared in: any (``after=`` may name a step
    declared later)."""
    size = draw(st.integers(min_value=1, max_value=6))
    steps = []
    for i in range(size):
        parents = {}
        for j in range(i):
            if draw(st.booleans()):
                parents[f"s{j}"] = draw(st.sampled_from(POLICIES))
        steps.append((f"s{i}", draw(st.sampled_from(QUEUES)), parents, draw(keys)))
    return steps, draw(st.permutations(range(size)))


def empty_tables() -> None:
    for model in (Message, ArchivedMessage, WorkflowEdge, WorkflowStep, WorkflowRun):
        model.objects.all().delete()


class WorkflowMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        empty_tables()
        self.runs: dict[int, RunModel] = {}
        self.handles: list[Message] = []  # claimed, not yet finished
        self.cancelled = False

    # --- the model ---

    def step_of(self, message_id: int) -> tuple[RunModel, StepModel]:
        for run in self.runs.values():
            for step in run.steps.values():
                if step.message_id == message_id and step.state == "enqueued":
                    return run, step
        raise AssertionError(f"message {message_id} is no enqueued step's")

    def enqueue_step(self, step: StepModel) -> None:
        step.state = "enqueued"
        step.enqueued += 1
        step.message_id = None  # read from its row (`learn_ids`)

    def settle(self, finished: list[tuple[int, str]]) -> list[StepModel]:
        """Steps' messages finished (message id, outcome), in one transaction: their steps settle, and
        their children are decided in waves, one workflow after another (models/workflows.py
        `settle_many`). Every message of the batch has left the live table first, so none of them holds
        its key any more. Returns the steps enqueued."""
        ended = [(*self.step_of(message_id), outcome) for message_id, outcome in finished]
        by_run: dict[int, list[tuple[str, str, str | None]]] = {}
        for run, step, outcome in ended:
            step.state = outcome
            by_run.setdefault(run.id, []).append((step.name, outcome, None))
        return settle_runs(self.runs, by_run, self.propagate)

    def release(self, run: RunModel, ready: list[StepModel]) -> tuple[list[StepModel], list[StepModel]]:
        """Enqueue ``ready`` steps in position order: a keyed one whose key a live message holds (one
        enqueued just before it too) is cancelled instead. Returns (refused, enqueued)."""
        refused, enqueued = [], []
        for step in sorted(ready, key=lambda s: run.positions[s.name]):
            holder = step.key and self.key_holder(step.queue, step.key)
            if holder:
                step.state, step.pending, step.holder = "cancelled", 0, holder
                refused.append(step)
            else:
                self.enqueue_step(step)
                enqueued.append(step)
        return refused, enqueued

    def key_holder(self, queue: str, key: str) -> StepModel | None:
        for run in self.runs.values():
            for step in run.steps.values():
                if step.state == "enqueued" and step.queue == queue and step.key == key:
                    return step
        return None

    def propagate(self, run: RunModel, wave: list[Settled]) -> list[StepModel]:
        """Decide the children of the steps settled in ``wave``, wave after wave; returns those enqueued."""
        return propagate(run, wave, self.release, cancel_doomed)

    def learn_ids(self) -> None:
        """The message ids of steps the model enqueued, read from their rows (the model cannot know them)."""
        for run in self.runs.values():
            unknown = [s for s in run.steps.values() if s.state == "enqueued" and s.message_id is None]
            if not unknown:
                continue
            rows = dict(
                WorkflowStep.objects.filter(workflow_id=run.id, name__in=[s.name for s in unknown]).values_list(
                    "name", "message_id"
                )
            )
            for step in unknown:
                assert rows.get(step.name) is not None, (
                    f"step {step.name} of {run.id}: no message; the model enqueued it"
                )
                step.message_id = rows[step.name]

    def ready(self, queues: list[str]) -> set[int]:
        claimed = {h.pk for h in self.handles}
        return {
            s.message_id
            for run in self.runs.values()
            for s in run.steps.values()
            if s.state == "enqueued" and s.queue in queues and s.message_id not in claimed
        }

    def ended(self) -> list[tuple[int, str]]:
        """Steps whose message ended dead, expired or cancelled (a replay can bring them back); keyed ones are left
        out (a replay of a keyed message goes through the key's rules, which this model leaves to
        tests/test_workflow_composition.py)."""
        return sorted(
            (run.id, s.name)
            for run in self.runs.values()
            for s in run.steps.values()
            if s.key is None
            and (s.state in ("dead", "expired") or (s.state == "cancelled" and s.message_id is not None))
        )

    # --- producers ---

    @initialize(data=st.data())
    def first_workflow(self, data):
        self.enqueue_workflow(data)

    @rule(data=st.data())
    def act(self, data):
        """One operation, drawn among those that can act now: claims and finishing steps the most often."""
        choices = []
        if self.ready(QUEUES):
            choices += ["claim", "claim", "cancel_queued", "expire"]
        if self.handles:
            choices += ["finish", "finish", "ack_then_claim", "ack_then_claim"]
        if self.ended():
            choices.append("replay")
        if not self.cancelled and any(run.open for run in self.runs.values()):
            choices.append("cancel_workflow")
        if len(self.runs) < 5:
            choices.append("enqueue_workflow")
        if choices:
            getattr(self, data.draw(st.sampled_from(choices), label="operation"))(data)

    def enqueue_workflow(self, data):
        graph, declared = data.draw(graphs(), label="graph")
        everywhere = data.draw(st.sampled_from([frozenset(), frozenset({"dead"})]), label="workflow policy")
        workflow = Workflow("props", ignore_dead="dead" in everywhere)
        steps: dict[str, StepModel] = {}
        for name, queue, parents, key in (graph[i] for i in declared):
            workflow.add(
                name,
                queue,
                {"step": name},
                after=[
                    Dep(
                        p,
                        ignore_dead="dead" in ign,
                        ignore_cancelled="cancelled" in ign,
                        ignore_expired="expired" in ign,
                    )
                    for p, ign in parents.items()
                ],
                **({"key": key} if key is not None else {}),
            )
        for name, queue, parents, key in graph:
            steps[name] = StepModel(name, queue, {p: ign | everywhere for p, ign in parents.items()}, key=key)
            steps[name].pending = len(parents)
            for parent in parents:
                steps[parent].children.append(name)
        run_id = workflow.enqueue().pk
        positions = {graph[i][0]: n for n, i in enumerate(declared)}
        run = self.runs[run_id] = RunModel(run_id, steps, open=len(steps), positions=positions)
        refused, _ = self.release(run, [step for step in steps.values() if not step.parents])
        run.open -= len(refused)
        run.failed += len(refused)
        self.propagate(run, [(step.name, "cancelled", None) for step in refused])
        self.learn_ids()

    # --- consumers ---

    def claim(self, data):
        queue = data.draw(st.sampled_from(QUEUES), label="queue")
        limit = data.draw(st.sampled_from([1, 2, 3]), label="limit")
        ready = self.ready([queue])
        claimed = django_dbqueue.claim(queue, limit, worker=WORKER)
        got = {m.pk for m in claimed}
        assert len(got) == len(claimed) == min(limit, len(ready)), f"claim({queue}, {limit}) took {got} of {ready}"
        assert got <= ready, f"claim({queue}, {limit}) took {got}; only {ready} are ready"
        self.handles += claimed

    def finish(self, data):
        handle = self.handles.pop(data.draw(st.integers(0, len(self.handles) - 1), label="handle"))
        dead = data.draw(st.booleans(), label="dead")
        done = handle.fail("boom", retry=False) if dead else handle.ack()
        assert done is True
        self.settle([(handle.pk, "dead" if dead else "acked")])
        self.learn_ids()

    def ack_then_claim(self, data):
        """A worker's batch of acks with its claim (the completer's): the claim only where they released a step."""
        indices = st.lists(st.integers(0, len(self.handles) - 1), min_size=1, max_size=4, unique=True)
        picked = sorted(data.draw(indices, label="handles"))
        queues = data.draw(st.sampled_from([QUEUES, QUEUES[:1], QUEUES[1:]]), label="queues")
        limit = data.draw(st.sampled_from([1, 2, 5]), label="limit")
        batch = [self.handles[i] for i in picked]
        self.handles = [h for i, h in enumerate(self.handles) if i not in picked]
        answers, taken = Message.objects.ack_then_claim(batch, queues, limit, worker=WORKER, visibility_timeout=300)
        assert answers == [True] * len(batch)
        released = self.settle([(h.pk, "acked") for h in batch])
        self.learn_ids()
        ready = self.ready(queues)
        got = {m.pk for m in taken}
        if any(step.queue in queues for step in released):
            assert len(got) == len(taken) == min(limit, len(ready)), f"claimed {got} of {ready} after acks"
            assert got <= ready
        else:
            assert taken == [], f"acks that released nothing on {queues} claimed {got}"
        self.handles += taken

    def expire(self, data):
        """Queued steps' messages pass their ``expires_at``: the reaper's batch archives them as expired and
        settles their steps in its transaction, the batch at once as an ack's."""
        ready = sorted(self.ready(QUEUES))
        picked = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=3, unique=True), label="expired")
        past = timezone.now() - timedelta(hours=1)
        assert Message.objects.filter(pk__in=picked).update(expires_at=past) == len(picked)
        expired, _ = Message.objects.expire_batch(100)
        assert sorted(m.pk for m in expired) == sorted(picked)
        self.settle([(pk, "expired") for pk in picked])
        self.learn_ids()

    # --- operators ---

    def cancel_queued(self, data):
        """Cancel a step's queued message (archived as cancelled at once), or ask a running one to stop."""
        live = sorted(s.message_id for run in self.runs.values() for s in run.steps.values() if s.state == "enqueued")
        if not live:
            return
        message_id = data.draw(st.sampled_from(live), label="message")
        result = control.cancel(message_id, by="ops")
        if message_id in {h.pk for h in self.handles}:
            assert result == control.CancelResult.REQUESTED
            return
        assert result == control.CancelResult.ARCHIVED, f"cancel of queued step message {message_id}: {result!r}"
        self.settle([(message_id, "cancelled")])
        self.learn_ids()

    def cancel_workflow(self, data):
        """Cancel a running workflow (once an example: a cancelled workflow has little left to test)."""
        self.cancelled = True
        running_runs = sorted(run.id for run in self.runs.values() if run.open)
        run = self.runs[data.draw(st.sampled_from(running_runs), label="workflow")]
        running = {h.pk for h in self.handles}
        waiting = [s for s in run.steps.values() if s.state == "waiting"]
        live = [s.message_id for s in run.steps.values() if s.state == "enqueued"]
        assert Workflow.cancel(run.id, by="ops") == len(live)
        if run.state() == "running":
            run.cancelled = True
        for step in waiting:
            step.state, step.reason = "cancelled", "workflow cancelled by ops"
        run.open -= len(waiting)
        run.failed += len(waiting)
        self.settle([(pk, "cancelled") for pk in live if pk not in running])
        self.learn_ids()

    def replay(self, data):
        """Replay a dead or cancelled step's message: the step is enqueued again, and the steps its end doomed
        wait again."""
        run_id, name = data.draw(st.sampled_from(self.ended()), label="step")
        run, step = self.runs[run_id], self.runs[run_id].steps[name]
        archived = ArchivedMessage.objects.get(message_id=step.message_id)
        control.replay(archived, by="ops")
        step.state, step.reason, step.message_id = "enqueued", "", None
        step.enqueued += 1
        doomed = [s for s in run.steps.values() if s.state == "cancelled" and s.cause == name]
        reopened = [name]
        for child in doomed:  # in dependency order
            ends = {parent: run.steps[parent] for parent in child.parents}
            dooms = sorted(
                doom(parent, end.state, end.cause)
                for parent, end in ends.items()
                if end.state in SETTLED and end.state != "acked" and end.state not in child.parents[parent]
            )
            if dooms:  # another dependency's end still dooms it
                child.cause, child.reason = dooms[0]
                continue
            child.state, child.cause, child.reason = "waiting", None, ""
            child.pending = sum(1 for end in ends.values() if end.state not in SETTLED)
            reopened.append(child.name)
        # A waiting step waits for each dependency not yet settled: one that tolerated an end the replay
        # undid (the step's own, or a cancel it cascaded) waits for that dependency again.
        for reopened_step in reopened:
            for name_after in run.steps[reopened_step].children:
                after = run.steps[name_after]
                if after.state == "waiting":
                    after.pending = sum(1 for p in after.parents if run.steps[p].state not in SETTLED)
        run.open += len(reopened)
        run.failed = max(run.failed - len(reopened), 0)
        self.learn_ids()

    # --- what must hold after every step ---

    @invariant()
    def the_database_agrees(self):
        if not self.runs:
            return
        rows = {
            (r["workflow_id"], r["name"]): r
            for r in WorkflowStep.objects.values(
                "workflow_id", "name", "state", "message_id", "reason", "pending", "cause"
            )
        }
        live = set(Message.objects.values_list("pk", flat=True))
        expected_live = set()
        enqueued = Counter(
            tuple(headers["dbqueue_step"])
            for model in (Message, ArchivedMessage)
            for headers in model.objects.values_list("headers", flat=True)
        )
        for run in self.runs.values():
            for step in run.steps.values():
                row = rows[(run.id, step.name)]
                assert row["state"] == step.state, f"step {step.name} of {run.id}: {row}, the model says {step}"
                if step.state == "waiting":
                    assert row["pending"] == step.pending, f"step {step.name} of {run.id}: {row}, model {step}"
                if step.state == "cancelled" and step.cause is not None:
                    assert row["reason"] == step.reason, f"step {step.name} of {run.id}: {row}, model {step}"
                if step.state == "cancelled" and step.holder is not None:
                    held = f"not enqueued: key {step.key!r} is held by live message {step.holder.message_id}"
                    assert row["reason"] == held, f"step {step.name} of {run.id}: {row['reason']!r}, not {held!r}"
                if step.state == "enqueued":
                    assert row["message_id"] == step.message_id
                    expected_live.add(step.message_id)
                times = enqueued[(run.id, step.name)]
                assert times == step.enqueued, (
                    f"step {step.name} of {run.id}: enqueued {times} times, not {step.enqueued}"
                )
                if step.state == "waiting":  # nothing waits for ever: each parent may still let it go
                    for parent, ignored in step.parents.items():
                        end = run.steps[parent].state
                        assert end in ("waiting", "enqueued", "acked", *ignored), (
                            f"step {step.name} of {run.id} waits after {parent}, which ended {end}"
                        )
            got = WorkflowRun.objects.filter(pk=run.id).values("open_steps", "failed_steps", "state", "outcome").get()
            want = {"open_steps": run.open, "failed_steps": run.failed, "state": run.state(), "outcome": run.outcome()}
            assert got == want, f"workflow {run.id}: {got}, the model says {want}"
        assert live == expected_live, f"live messages {sorted(live)}, the model says {sorted(expected_live)}"
        self.the_steps_agree_with_their_edges(rows)

    @staticmethod
    def the_steps_agree_with_their_edges(rows: dict[tuple[int, str], dict]) -> None:
        """What the database's own rows must say of each other, whatever the model says (docs/workflows.md):
        a waiting step's pending count is its dependencies not yet settled, and a step cancelled by a
        dependency's end has a dependency that ended as it does not tolerate."""
        parents: dict[tuple[int, str], list[tuple[str, str]]] = {}
        for run_id, parent, child, ignore in WorkflowEdge.objects.values_list(
            "workflow_id", "parent", "child", "ignore"
        ):
            parents.setdefault((run_id, child), []).append((parent, ignore))
        for (run_id, name), row in rows.items():
            ends = [(rows[(run_id, p)]["state"], ignore.split(",")) for p, ignore in parents.get((run_id, name), [])]
            if row["state"] == "waiting":
                open_parents = sum(1 for state, _ in ends if state in ("waiting", "enqueued"))
                assert row["pending"] == open_parents, (
                    f"step {name} of {run_id} waits for {row['pending']}, not {open_parents}"
                )
            if row["state"] == "cancelled" and row["cause"] is not None:
                assert any(
                    state in ("dead", "cancelled", "expired") and state not in ignored for state, ignored in ends
                ), f"step {name} of {run_id} is cancelled for {row['cause']!r}, but no dependency's end dooms it: {row}"


def test_workflows_keep_their_documented_promises_under_random_steps():
    run_machine(WorkflowMachine, PROFILES)
