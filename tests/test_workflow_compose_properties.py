"""A stateful property test of workflow steps with keys, delays and flow rules, against a model of the docs.

tests/test_workflow_properties.py checks the graph (policies, cancels,
replays) on plain queues with plain steps. Here the steps carry the other
enqueue options, and the queues have flow rules, because that is where a
step stops being "a message of its own": Hypothesis declares small
workflows (up to four steps) whose steps take a `key` (live, a `unique`
window, or `debounce`), a `group`, a `kind`, a `delay` or a `run_at`, on
queues with `ORDERED`, `GROUP_CONCURRENCY` (and a kind's own limit),
`RATE_LIMIT` (for the queue, and per group), or none; plain producers
write to the same keys and groups between them; then claims, acks, dead
letters, retries, batches of acks (with the worker's claim in them),
cancels, clock advances and reaper passes. A plain Python model of
docs/workflows.md ("Keyed steps", "Flow control", "Policies", "The
reaper"), docs/flow-control.md and docs/api.md says after every step what
the database must hold:

- each step's state and, where the docs give it, its reason (the key and
  the live message that refused it, a unique window, the dependency that
  doomed it, the message that ran as another's);
- exactly the live messages the model has, each with its queue, key,
  group, kind, payload, attempts, state (ready, scheduled, in flight) and
  the step it runs; the archive's outcomes; every step's header on
  exactly the messages the model says (none run twice, none lost);
- a group's messages queued in the order they were enqueued;
- a claim takes only what the rules let through now (delays, FIFO heads,
  group and kind limits, rate budgets, and of the messages set aside, only
  those a claim brings back), as many as they let through, and the first
  of them. The tests at the end pin down the disagreements with the docs
  that this machine found, each fixed since.

Time is the model's, in whole ``TICK`` s, as in tests/test_properties.py:
an advance moves the live messages, the unique windows and the rate slots
back. It does not move a step's ``run_at`` before the step is enqueued
(docs/testing.md: only live messages move), so in model time a waiting
step's ``run_at`` moves forward with every advance; that a `delay` counts
from the moment the step is ready, not from its declaration, is checked
on the real clock by a small test at the end.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import django_dbqueue
from django_dbqueue import Dep, Workflow, control
from django_dbqueue.conf import queue_options
from django_dbqueue.db.clock import db_now
from django_dbqueue.models import (
    ArchivedMessage,
    FlowGroup,
    Message,
    RateSlot,
    UniqueWindow,
    WorkflowEdge,
    WorkflowRun,
    WorkflowStep,
    flow,
)
from django_dbqueue.reaper import Reaper
from tests.support.doc_models import Rules, RunModel, Settled, claimable, doom, propagate, settle_runs
from tests.support.machines import Profiles, advance, run_machine

pytestmark = pytest.mark.django_db(transaction=True)

TICK = 30  # seconds: every delay, window, backoff and rate period is a multiple of it
LEASE = 24 * 3600  # every claim's lease: none runs out in an example (lost leases are tests/test_properties.py's)
MAX_ATTEMPTS = 3
WORKER = "wc-worker"
RULES: dict[str, dict[str, Any]] = {
    "wc-plain": {},
    "wc-fifo": {"ORDERED": True},
    "wc-groups": {"GROUP_CONCURRENCY": 1, "KIND_GROUP_CONCURRENCY": {"solo": 1}},
    "wc-rate": {"RATE_LIMIT": "2/m"},
    "wc-rate-group": {"RATE_LIMIT": "1/m per group"},
}
QUEUES = list(RULES)
OPERATIONS = ["claim"] * 3 + ["finish"] * 3 + ["enqueue_workflow"] * 2 + ["enqueue_plain", "ack_batch", "wait"]
OPERATIONS += ["cancel_message", "cancel_workflow"]
POLICIES = [frozenset(), frozenset(), frozenset({"cancelled"}), frozenset({"dead"})]

PROFILES: Profiles = {
    # name: (max_examples, stateful_step_count) per database vendor
    "ci": {"sqlite": (150, 30), "mysql": (100, 30), "postgresql": (100, 30)},
    "long": {"sqlite": (1500, 30), "mysql": (400, 30), "postgresql": (400, 30)},
}


# --- what is enqueued ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """A message's enqueue options, as drawn: ``rule`` is ``live``, ``unique`` or ``debounce`` (with ``amount``
    seconds), ``timing`` is ``""``, ``delay`` or ``run_at`` (``at`` seconds from now, which may be past)."""

    key: str | None = None
    rule: str = "live"
    amount: int = 0
    group: str | None = None
    kind: str = ""
    timing: str = ""
    at: int = 0

    def options(self) -> dict[str, Any]:
        options: dict[str, Any] = {}
        if self.key is not None:
            options["key"] = self.key
            if self.rule != "live":
                options[self.rule] = timedelta(seconds=self.amount)
        if self.group is not None:
            options["group"] = self.group
        if self.kind:
            options["kind"] = self.kind
        if self.timing == "delay":
            options["delay"] = timedelta(seconds=self.at)
        elif self.timing == "run_at":
            options["run_at"] = db_now("default") + timedelta(seconds=self.at)
        return options


# One key held by live messages and debounced, one with unique windows: the docs leave open what a unique
# window means to an enqueue of its key without one (no test here mixes them).
step_keys = st.sampled_from(
    [(None, "live", 0)] * 3
    + [("k", "live", 0), ("k", "debounce", TICK), ("k", "debounce", 2 * TICK), ("u", "unique", TICK)]
    + [("u", "unique", 4 * TICK)]
)
# Other producers mostly write to the keys: their debounce is what takes a step's message over.
plain_keys = st.sampled_from(
    [(None, "live", 0), ("k", "live", 0), ("k", "debounce", TICK), ("k", "debounce", TICK), ("u", "unique", TICK)]
)
timings = st.sampled_from([("", 0), ("", 0), ("delay", TICK), ("delay", 2 * TICK), ("run_at", -TICK), ("run_at", TICK)])
groups = st.sampled_from([None, "g1", "g1", "g2"])
indices = st.integers(min_value=0, max_value=99)  # into whatever list there is now, modulo its length
kinds = st.sampled_from(["", "", "solo"])


@st.composite
def specs(draw, keys=step_keys) -> Spec:
    key, rule_name, amount = draw(keys)
    timing, at = draw(timings)
    if rule_name == "debounce":  # debounce sets the time itself (docs/api.md)
        timing, at = "", 0
    return Spec(key, rule_name, amount, draw(groups), draw(kinds), timing, at)


@st.composite
def graphs(draw, queues: list[str]):
    """Steps ``s0``..``sN`` declared in dependency order, each after a random set of earlier ones (each edge
    with a policy), on one of ``queues``, with its enqueue options."""
    size = draw(st.integers(min_value=1, max_value=4))
    steps = []
    for i in range(size):
        parents = {f"s{j}": draw(st.sampled_from(POLICIES)) for j in range(i) if draw(st.booleans())}
        steps.append((f"s{i}", draw(st.sampled_from(queues)), parents, draw(specs())))
    return steps


# --- the model ----------------------------------------------------------------------------------


@dataclass(eq=False)
class Msg:
    """A message as the docs say it is. ``available`` is (model time, write order): equal times are claimed in
    the order they were written. ``order`` is the enqueue order (a FIFO group's)."""

    queue: str
    kind: str
    key: str | None
    group: str | None
    payload: Any
    available: tuple[int, int]
    order: int
    owner: tuple[int, str] | None  # the step it runs (its header), or None: a plain producer's
    id: int | None = None  # known from the database once written (a step's from its row)
    attempts: int = 0
    token: str | None = None
    flagged: bool = False

    def in_flight(self) -> bool:
        return self.token is not None  # no lease runs out here

    def state(self, now: int) -> str:
        if self.in_flight():
            return "in_flight"
        return "ready" if self.available[0] <= now else "scheduled"

    def waiting(self) -> bool:
        """Live and never started: what a debounce replaces (docs/flow-control.md)."""
        return self.token is None and self.attempts == 0


@dataclass(eq=False)
class StepModel:
    name: str
    queue: str
    spec: Spec
    parents: dict[str, frozenset[str]]  # parent -> the outcomes this step tolerates besides acked
    position: int
    declared: int  # the write order of its declaration (a run_at is a time of the database's clock from then)
    children: list[str] = field(default_factory=list)
    state: str = "waiting"
    pending: int = 0
    cause: str | None = None
    why: tuple[str, Any] | None = None  # what its reason must say, when the docs say it
    msg: Msg | None = None


def cancel_doomed(step: StepModel, origin: str, reason: str) -> None:
    """A step its dependency's end cancels: its reason names ``origin``, read back from the database."""
    step.state, step.cause, step.why = "cancelled", origin, ("doomed", None)


def backoff(attempts: int) -> int:
    """The wait after failed attempt ``attempts`` (docs/concepts.md, no jitter): whole ticks here."""
    options = queue_options("wc-plain")
    return int(min(options.backoff_max, options.backoff_base * 2 ** (attempts - 1)))


def empty_tables() -> None:
    for model in (Message, ArchivedMessage, WorkflowEdge, WorkflowStep, WorkflowRun, FlowGroup, RateSlot, UniqueWindow):
        model.objects.all().delete()


def step_header(headers: dict | None) -> tuple[int, str] | None:
    ref = (headers or {}).get("dbqueue_step")
    return None if ref is None else (ref[0], ref[1])


class ComposeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        empty_tables()
        self.now = 0
        self.seq = itertools.count(1)
        self.live: list[Msg] = []
        self.archived: dict[int, tuple[Msg, str]] = {}
        self.ids: dict[int, Msg] = {}  # every message id seen, and whose
        self.windows: dict[tuple[str, str], int] = {}  # (queue, key) -> until
        self.claims: dict[tuple[str, str], list[int]] = {}  # (queue, group or "") -> claim times
        self.runs: dict[int, RunModel] = {}
        self.handles: list[Message] = []
        self.plain = 0
        self.cancelled = False

    @initialize(chosen=st.lists(st.sampled_from(QUEUES), min_size=1, max_size=2, unique=True), data=st.data())
    def first_workflow(self, chosen, data):
        """The example's steps and producers use one or two queues: their keys, groups and limits meet there."""
        self.queues = chosen
        self.enqueue_workflow(data)
        self.learn_ids()
        self.learn_dooms()

    # --- the insert path (docs/flow-control.md, "Unique windows and debounce"; api.md, enqueue) ---

    def holder(self, queue: str, key: str) -> Msg | None:
        return next((m for m in self.live if m.queue == queue and m.key == key), None)

    def write(self, queue: str, spec: Spec, payload: Any, owner, available: tuple[int, int]) -> Msg:
        msg = Msg(queue, spec.kind, spec.key, spec.group, payload, available, next(self.seq), owner)
        self.live.append(msg)
        return msg

    def put(self, queue: str, spec: Spec, payload: Any, owner, available: tuple[int, int]) -> tuple[str, Msg | None]:
        """One enqueue by the documented rules: ("created" | "replaced" | "moved", its message), or ("held", the
        key's live message), or ("window", None)."""
        if spec.key is None:
            return "created", self.write(queue, spec, payload, owner, available)
        live = self.holder(queue, spec.key)
        if spec.rule == "debounce":
            due = (self.now + spec.amount, next(self.seq))
            if live is None:
                return "created", self.write(queue, spec, payload, owner, due)
            if not live.waiting():  # running or retrying: left alone
                return "held", live
            if live.group != spec.group:  # another group: deleted, and a new row queues last in its group
                self.live.remove(live)
                return "moved", self.write(queue, spec, payload, owner, due)
            live.payload, live.kind, live.owner, live.available = payload, spec.kind, owner, due
            return "replaced", live
        if live is not None:
            return "held", live
        if spec.rule == "unique":
            until = self.windows.get((queue, spec.key))
            if until is not None and until > self.now:
                return "window", None
            self.windows[(queue, spec.key)] = self.now + spec.amount
        return "created", self.write(queue, spec, payload, owner, available)

    # --- the workflows (docs/workflows.md) ---

    def due(self, step: StepModel) -> tuple[int, int]:
        """When a step's message is due: a delay counts from now, when it is ready; a run_at is a time of the
        database's clock, which an advance does not move while the step waits (docs/testing.md)."""
        if step.spec.timing == "run_at":
            return self.now + step.spec.at, step.declared
        return self.now + (step.spec.at if step.spec.timing == "delay" else 0), next(self.seq)

    def release(self, run: RunModel, ready: list[StepModel]) -> tuple[list[StepModel], list[StepModel]]:
        """Enqueue ``ready`` steps in declaration order through the insert path: a step whose key keeps it out
        is cancelled (docs/workflows.md, "Keyed steps"). Returns (refused, enqueued)."""
        refused, enqueued = [], []
        for step in sorted(ready, key=lambda s: s.position):
            outcome, msg = self.put(step.queue, step.spec, {"step": step.name}, (run.id, step.name), self.due(step))
            if outcome in ("held", "window"):
                step.state, step.pending, step.why = "cancelled", 0, (outcome, msg)
                refused.append(step)
            else:
                step.state, step.msg = "enqueued", msg
                enqueued.append(step)
        return refused, enqueued

    def propagate(self, run: RunModel, wave: list[Settled]) -> list[StepModel]:
        """Decide the children of the steps settled in ``wave``, wave after wave; returns those enqueued."""
        return propagate(run, wave, self.release, cancel_doomed)

    def settle(self, finished: list[tuple[Msg, str]]) -> list[StepModel]:
        """Messages finished (with their outcomes) in one transaction: each leaves the live table, and the
        steps they ran settle, their children decided per workflow. Returns the steps enqueued."""
        by_run: dict[int, list[tuple[str, str, str | None]]] = {}
        for msg, outcome in finished:
            self.live.remove(msg)
            assert msg.id is not None
            self.archived[msg.id] = (msg, outcome)
        for msg, outcome in finished:
            if msg.owner is None:
                continue
            run = self.runs[msg.owner[0]]
            step = run.steps[msg.owner[1]]
            assert step.state == "enqueued" and step.msg is msg, f"message {msg.id} runs {step}"
            step.state = outcome
            by_run.setdefault(run.id, []).append((step.name, outcome, None))
        return settle_runs(self.runs, by_run, self.propagate)

    def displaced(self) -> list[tuple[RunModel, StepModel]]:
        """Enqueued steps whose message left the live table without settling them: it ran as another's, or a
        debounce moved it (docs/workflows.md, "The reaper")."""
        return [
            (run, step)
            for run in self.runs.values()
            for step in run.steps.values()
            if step.state == "enqueued" and step.msg not in self.live
        ]

    def learn_ids(self) -> None:
        """The ids of the messages the join wrote, read from their steps' rows (the model cannot know them)."""
        for run in self.runs.values():
            unknown = [s for s in run.steps.values() if s.msg is not None and s.msg.id is None]
            if not unknown:
                continue
            rows = dict(
                WorkflowStep.objects.filter(workflow_id=run.id, name__in=[s.name for s in unknown]).values_list(
                    "name", "message_id"
                )
            )
            for step in unknown:
                if step.msg.id is None:  # two steps may share one (a debounce of one on the other's)
                    self.learn(step.msg, rows.get(step.name), f"step {step.name} of {run.id}")
        assert all(m.id is not None for m in self.live)

    def learn_dooms(self) -> None:
        """Which dependency the steps doomed by the last operation name. Where several ended in it as a step
        does not tolerate (a batch of acks, a reaper's pass, a refused key and a dead letter), the docs do not
        say which one the reason names: any of them may be, and the model takes the database's, which the
        steps after it name in turn (docs/workflows.md, "Policies")."""
        for run in self.runs.values():
            doomed = [s for s in run.steps.values() if s.why == ("doomed", None)]
            if not doomed:
                continue
            rows = {
                name: (cause, reason)
                for name, cause, reason in WorkflowStep.objects.filter(
                    workflow_id=run.id, name__in=[s.name for s in doomed]
                ).values_list("name", "cause", "reason")
            }
            for step in doomed:  # in dependency order: a parent's origin is known before its children's
                ends = {p: run.steps[p] for p in step.parents}
                may = {
                    doom(p, end.state, end.cause)
                    for p, end in ends.items()
                    if end.state in ("dead", "expired", "cancelled") and end.state not in step.parents[p]
                }
                got = rows[step.name]
                assert got in may, f"step {step.name} of {run.id}: (cause, reason) {got}, not one of {sorted(may)}"
                step.cause, step.why = got[0], ("doomed", got[1])

    def learn(self, msg: Msg, pk: int | None, what: str) -> None:
        assert pk is not None, f"{what}: no message; the model enqueued it"
        assert self.ids.get(pk, msg) is msg, f"{what}: message {pk} is already {self.ids[pk]}"
        msg.id = pk
        self.ids[pk] = msg

    # --- what a claim may take (docs/flow-control.md) ---

    def eligible(self, queue: str, limit: int, aside: frozenset[int] = frozenset()) -> tuple[list[Msg], set[int]]:
        """The greedy pick of ``limit`` in claim order under the queue's rules, and every id a rule lets through
        (`claimable`; ``aside``: the messages set aside before the claim)."""
        rules = Rules.of(queue)
        rate_period = rules.rate[1] if rules.rate is not None else 0
        return claimable(
            rules,
            [m for m in self.live if m.queue == queue],
            limit,
            ready=lambda m: m.state(self.now) == "ready",
            in_flight=Msg.in_flight,
            claim_order=lambda m: (m.available, m.id or 0),
            fifo_order=lambda m: m.order,
            used=lambda scope: sum(1 for t in self.claims.get((queue, scope), []) if t > self.now - rate_period),
            aside=aside,
        )

    def check_claim(
        self, queue: str, limit: int, claimed: list[Message], what: str, aside: frozenset[int] = frozenset()
    ) -> None:
        """``aside``: the ids of the queue's messages set aside before the claim (`eligible`)."""
        picks, allowed = self.eligible(queue, limit, aside)
        got = [m.pk for m in claimed]
        assert set(got) <= allowed, f"{what} took {got}; only {sorted(allowed)} may run now"
        assert len(got) == len(set(got)) <= limit
        assert len(got) == len(picks), f"{what} took {got}; the rules let {[m.id for m in picks]} go"
        # The first in claim order, or one due at the same model time: on SQLite two writes in one millisecond
        # have one time.
        first = picks[0].available[0] if picks else None
        level = {m.id for m in self.live if m.id in allowed and m.available[0] == first}
        assert not picks or level & set(got), f"{what} took {got}, not the first eligible {picks[0].id}"
        rules = Rules.of(queue)
        for message in claimed:
            m = self.ids[message.pk]
            m.attempts += 1
            m.token = message.lease_token
            assert message.attempts == m.attempts, f"message {m.id}: attempts {message.attempts}, not {m.attempts}"
            if rules.rate is not None:
                gk = (m.group or "") if rules.rate[2] else ""
                self.claims.setdefault((queue, gk), []).append(self.now)
        self.handles += claimed

    # --- the operations ---

    @rule(data=st.data())
    def act(self, data):
        """One operation, claims and finishing messages the most often. Each draws the same shape of data in any
        state (an index into what there is, not a choice among it) and does nothing when it cannot act: the
        database may break a tie between two messages written in one millisecond either way, and Hypothesis
        replays an example's draws into whichever state that gives."""
        getattr(self, data.draw(st.sampled_from(OPERATIONS), label="operation"))(data)
        self.learn_ids()
        self.learn_dooms()

    def enqueue_workflow(self, data):
        graph = data.draw(graphs(self.queues), label="graph")
        if len(self.runs) >= 4:
            return
        workflow = Workflow("compose")
        steps: dict[str, StepModel] = {}
        for position, (name, queue, parents, spec) in enumerate(graph):
            after = [
                Dep(p, ignore_dead="dead" in ign, ignore_cancelled="cancelled" in ign) for p, ign in parents.items()
            ]
            workflow.add(name, queue, {"step": name}, after=after, **spec.options())
            steps[name] = StepModel(name, queue, spec, parents, position, next(self.seq), pending=len(parents))
            for parent in parents:
                steps[parent].children.append(name)
        run_id = workflow.enqueue().pk
        run = self.runs[run_id] = RunModel(run_id, steps, open=len(steps))
        refused, _ = self.release(run, [step for step in steps.values() if not step.parents])
        run.open -= len(refused)
        run.failed += len(refused)
        self.propagate(run, [(step.name, "cancelled", None) for step in refused])

    def enqueue_plain(self, data):
        """Another producer writes to the example's keys and groups: it holds keys, fills groups (a few messages
        at once), uses the rate, and its debounce may take a step's message over."""
        queue = data.draw(st.sampled_from(self.queues), label="queue")
        spec = data.draw(specs(plain_keys), label="options")
        count = data.draw(st.sampled_from([1, 1, 2, 3]), label="count")
        if count > 1:
            spec = Spec(group=spec.group, kind=spec.kind, timing=spec.timing, at=spec.at)
        for _ in range(count):
            self.plain += 1
            payload = {"plain": self.plain}
            message = django_dbqueue.enqueue(queue, payload, **spec.options())
            available = (self.now + (spec.at if spec.timing else 0), next(self.seq))
            outcome, msg = self.put(queue, spec, payload, None, available)
            what = f"{spec} into {queue}"
            if outcome == "created":
                assert message.was_created, f"{what} inserted nothing"
                self.learn(msg, message.pk, what)
            elif outcome == "moved":  # a new row, last in its new group
                assert message.pk is not None and message.pk not in self.ids, f"{what}: {message.pk}"
                self.learn(msg, message.pk, what)
            elif outcome == "window":
                assert (message.pk, message.was_created) == (None, False), f"{what}: inside its window"
            else:  # held, or replaced: the key's live message is returned
                assert (message.pk, message.was_created) == (msg.id, False), f"{what}: {outcome} {msg}"

    def claim(self, data):
        queue = data.draw(st.sampled_from(self.queues), label="queue")
        limit = data.draw(st.sampled_from([1, 2, 3]), label="limit")
        aside = frozenset(Message.objects.filter(queue=queue, held_priority__isnull=False).values_list("pk", flat=True))
        claimed = django_dbqueue.claim(queue, limit, worker=WORKER, visibility_timeout=LEASE)
        self.check_claim(queue, limit, claimed, f"claim({queue!r}, {limit})", aside)

    def take(self, index: int) -> tuple[Message, Msg]:
        handle = self.handles.pop(index % len(self.handles))
        msg = self.ids[handle.pk]
        assert msg in self.live and msg.token == handle.lease_token
        return handle, msg

    def finish(self, data):
        """Ack, dead-letter, or fail with a retry (a retrying message keeps its key and its FIFO group)."""
        index = data.draw(indices, label="handle")
        how = data.draw(st.sampled_from(["ack", "ack", "dead", "retry"]), label="how")
        if not self.handles:
            return
        handle, msg = self.take(index)
        if how == "retry" and msg.flagged:  # a cancelled running message is the worker's to archive
            how = "dead"
        done = handle.ack() if how == "ack" else handle.fail("boom", retry=how == "retry")
        assert done is True
        if how == "retry" and msg.attempts < MAX_ATTEMPTS:
            msg.token = None
            msg.available = (self.now + backoff(msg.attempts), next(self.seq))
            return
        self.settle([(msg, "acked" if how == "ack" else "dead")])

    def ack_batch(self, data):
        """Acks of a batch in one transaction; for a worker on the queue with no rules, with its claim in the
        same transaction where the acks released a step there (docs/workflows.md, "Cost"; a worker leaves
        the queues with flow rules out of that claim)."""
        picked = data.draw(st.lists(indices, min_size=1, max_size=3), label="handles")
        then_claim = data.draw(st.booleans(), label="then claim")
        limit = data.draw(st.sampled_from([1, 2]), label="limit")
        served = [q for q in self.queues if not RULES[q]]
        then_claim = then_claim and bool(served)
        batch = [self.take(index) for index in picked[: len(self.handles)]]
        if not batch:
            return
        handles = [handle for handle, _ in batch]
        if then_claim:
            answers, taken = Message.objects.ack_then_claim(
                handles, served, limit, worker=WORKER, visibility_timeout=LEASE
            )
        else:
            answers, taken = django_dbqueue.ack_many(handles), []
        assert answers == [True] * len(batch)
        released = self.settle([(msg, "acked") for _, msg in batch])
        self.learn_ids()
        if then_claim and any(step.queue in served for step in released):
            self.check_claim(served[0], limit, taken, f"the claim in acks of {[h.pk for h in handles]}")
        else:
            assert taken == [], f"acks that released nothing on {served} claimed {[m.pk for m in taken]}"

    def cancel_message(self, data):
        """An operator cancels a message that is not running: archived as cancelled, its step with it."""
        index = data.draw(indices, label="message")
        idle = sorted(m.id for m in self.live if not m.in_flight())
        if not idle:
            return
        msg = self.ids[idle[index % len(idle)]]
        assert control.cancel(msg.id, by="ops") == control.CancelResult.ARCHIVED
        self.settle([(msg, "cancelled")])

    def cancel_workflow(self, data):
        """Cancel a running workflow (once an example): its waiting steps, and the messages its steps still run;
        a message another's debounce took over is left alone (docs/workflows.md, "Keyed steps")."""
        index = data.draw(indices, label="workflow")
        running = sorted(r.id for r in self.runs.values() if r.open)
        if self.cancelled or not running:
            return
        self.cancelled = True
        run = self.runs[running[index % len(running)]]
        waiting = [s for s in run.steps.values() if s.state == "waiting"]
        ours = [
            s.msg
            for s in run.steps.values()
            if s.state == "enqueued" and s.msg in self.live and s.msg.owner == (run.id, s.name)
        ]
        assert Workflow.cancel(run.id, by="ops") == len(ours)
        run.cancelled = True
        for step in waiting:
            step.state, step.why = "cancelled", ("exact", "workflow cancelled by ops")
        run.open -= len(waiting)
        run.failed += len(waiting)
        for msg in ours:
            msg.flagged = msg.in_flight()
        self.settle([(msg, "cancelled") for msg in ours if not msg.in_flight()])

    def wait(self, data):
        """Time passes, then the reaper makes a pass: it cancels the steps whose message ran as another's or left
        without an archive row, and their dependents follow."""
        ticks = data.draw(st.integers(0, 2), label="ticks")
        if ticks:
            advance(ticks * TICK)
            self.now += ticks * TICK
        report = Reaper().run_once()
        assert report is not None
        gone = self.displaced()
        assert report.steps_settled == len(gone), (
            f"the reaper settled {report.steps_settled}, not {len(gone)}: {report}"
        )
        by_run: dict[int, list[tuple[str, str, str | None]]] = {}
        for run, step in gone:
            ran = step.msg.id in self.archived
            step.state, step.why = "cancelled", ("ran" if ran else "moved", step.msg)
            by_run.setdefault(run.id, []).append((step.name, "cancelled", None))
        for run_id in sorted(by_run):
            run = self.runs[run_id]
            run.open -= len(by_run[run_id])
            run.failed += len(by_run[run_id])
            self.propagate(run, by_run[run_id])

    # --- what must hold after every step ---

    def reason(self, step: StepModel) -> tuple[str, str] | None:
        """("exact" | "contains", text) that the step's reason must match, or None where the docs give none."""
        if step.why is None:
            return None
        what, about = step.why
        if what == "held":
            return "exact", f"not enqueued: key {step.spec.key!r} is held by live message {about.id}"
        if what == "window":
            return "exact", f"not enqueued: key {step.spec.key!r} was taken less than its unique window ago"
        if what == "ran":
            return "exact", f"its message {about.id} ran as another's: an enqueue with debounce on its key replaced it"
        if what == "moved":
            return "contains", "left the queue without an archive row"
        if what == "doomed" and about is None:
            return None
        return "exact", about

    @invariant()
    def the_database_agrees(self):
        if not hasattr(self, "queues"):
            return
        self.the_steps_agree()
        self.the_messages_agree()

    def the_steps_agree(self) -> None:
        rows = {
            (r["workflow_id"], r["name"]): r
            for r in WorkflowStep.objects.values("workflow_id", "name", "state", "message_id", "reason", "pending")
        }
        for run in self.runs.values():
            for step in run.steps.values():
                row = rows[(run.id, step.name)]
                assert row["state"] == step.state, f"step {step.name} of {run.id}: {row}, the model says {step}"
                if step.state == "waiting":
                    assert row["pending"] == step.pending, f"step {step.name} of {run.id}: {row}, model {step}"
                if step.state == "enqueued":
                    assert row["message_id"] == step.msg.id, f"step {step.name} of {run.id}: {row}, model {step.msg}"
                want = self.reason(step) if step.state == "cancelled" else None
                if want is not None:
                    how, text = want
                    ok = row["reason"] == text if how == "exact" else text in row["reason"]
                    assert ok, f"step {step.name} of {run.id}: reason {row['reason']!r}, not {text!r}"
            got = WorkflowRun.objects.filter(pk=run.id).values("open_steps", "failed_steps", "state", "outcome").get()
            want = {"open_steps": run.open, "failed_steps": run.failed, "state": run.state(), "outcome": run.outcome()}
            assert got == want, f"workflow {run.id}: {got}, the model says {want}"

    def the_messages_agree(self) -> None:
        now = db_now("default")
        rows = self.live_rows(now)
        assert set(rows) == {m.id for m in self.live}, (
            f"live messages {sorted(rows)}, the model says {sorted(m.id for m in self.live)}"
        )
        for m in self.live:
            row = rows[m.id]
            got = (row["queue"], row["kind"], row["key"], row["group"], row["payload"], row["attempts"])
            want = (m.queue, m.kind, m.key, m.group, m.payload, m.attempts)
            assert got == want, f"message {m.id}: {got}, the model says {want}"
            assert step_header(row["headers"]) == m.owner, f"message {m.id} runs {row['headers']}, not {m.owner}"
            assert row["state"] == m.state(self.now), f"message {m.id} is {row['state']}, not {m.state(self.now)}"
            if row["held_priority"] is not None:  # set aside by a claim (docs/flow-control.md): its own kept
                assert row["priority"] == flow.SET_ASIDE and row["state"] != "in_flight", row
                row["priority"] = row["held_priority"]
            assert row["priority"] == 0, f"message {m.id}: priority {row}"
        archive = list(ArchivedMessage.objects.values_list("message_id", "outcome", "headers"))
        assert len({pk for pk, _, _ in archive}) == len(archive), "a message archived twice"
        got_archive = {pk: (outcome, step_header(headers)) for pk, outcome, headers in archive}
        want_archive = {pk: (outcome, m.owner) for pk, (m, outcome) in self.archived.items()}
        assert got_archive == want_archive, f"archive {got_archive}, the model says {want_archive}"
        # Each step's header on exactly the messages the model gave it: none enqueued twice, none lost.
        carried = Counter(step_header(r["headers"]) for r in rows.values())
        carried.update(step_header(headers) for _, _, headers in archive)
        owned = Counter(m.owner for m in self.live)
        owned.update(m.owner for m, _ in self.archived.values())
        assert carried == owned, f"step headers {carried}, the model says {owned}"
        # A group's messages queue in their enqueue order (docs/workflows.md, "Flow control").
        for queue, group in {(m.queue, m.group) for m in self.live if m.group is not None}:
            mine = sorted((m for m in self.live if (m.queue, m.group) == (queue, group)), key=lambda m: m.order)
            ids = [m.id for m in mine]
            assert ids == sorted(ids), f"group {group} of {queue}: ids {ids} are not in enqueue order"

    @staticmethod
    def live_rows(now) -> dict[int, dict[str, Any]]:
        rows = {}
        for row in Message.objects.values(
            "id",
            "queue",
            "kind",
            "key",
            "group",
            "payload",
            "attempts",
            "headers",
            "priority",
            "held_priority",
            "lease_token",
            "available_at",
        ):
            row["state"] = (
                "ready" if row["available_at"] <= now else "scheduled" if row["lease_token"] is None else "in_flight"
            )
            rows[row["id"]] = row
        return rows


@pytest.fixture
def compose_queues(settings):
    """The example's queues: every time a multiple of ``TICK``, no jitter, one rule (or none) each."""
    base = {"BACKOFF_BASE": TICK, "BACKOFF_JITTER": 0, "MAX_ATTEMPTS": MAX_ATTEMPTS}
    queues = {name: {**base, **rules} for name, rules in RULES.items()}
    settings.DBQUEUE = {**settings.DBQUEUE, "QUEUES": {**settings.DBQUEUE.get("QUEUES", {}), **queues}}


def test_workflow_steps_keep_the_key_delay_and_flow_rules_of_their_queues(compose_queues):
    run_machine(ComposeMachine, PROFILES)


# --- on the real clock ------------------------------------------------------------------------------


def test_a_steps_delay_counts_from_when_it_is_ready_and_its_run_at_is_kept(compose_queues):
    """The model's time cannot tell a delay counted from the declaration from one counted when the step is ready
    (the time travel moves neither); the database's clock can: half a second passes between the two."""
    run_at = db_now("default") + timedelta(minutes=2)
    workflow = Workflow("later")
    workflow.add("a", "wc-plain")
    workflow.add("b", "wc-plain", after=["a"], delay=timedelta(minutes=1))
    workflow.add("c", "wc-plain", after=["a"], run_at=run_at)
    run = workflow.enqueue()
    time.sleep(0.5)
    [a] = django_dbqueue.claim("wc-plain")
    before = db_now("default")
    assert a.ack() is True
    after = db_now("default")
    due = {step_header(h)[1]: available for h, available in Message.objects.values_list("headers", "available_at")}
    assert before + timedelta(minutes=1) <= due["b"] <= after + timedelta(minutes=1), (before, due["b"], after)
    assert abs(due["c"] - run_at) < timedelta(milliseconds=1), (due["c"], run_at)
    assert django_dbqueue.claim("wc-plain", 10) == []
    assert dict(WorkflowStep.objects.filter(workflow=run).values_list("name", "state")) == {
        "a": "acked",
        "b": "enqueued",
        "c": "enqueued",
    }


# --- disagreements with the docs that the machine above found, each fixed ------------------------------------


def test_root_steps_of_one_fifo_group_run_in_declaration_order(compose_queues):
    workflow = Workflow("ledger")
    workflow.add("first", "wc-fifo", {}, key="entry:1", group="acct")
    workflow.add("second", "wc-fifo", {}, group="acct")
    workflow.enqueue()
    [head] = django_dbqueue.claim("wc-fifo", 5)
    assert head.headers["dbqueue_step"][1] == "first"


def test_of_two_root_steps_with_one_key_the_first_declared_takes_it(compose_queues):
    workflow = Workflow("twins")
    workflow.add("first", "wc-plain", {}, key="k")
    workflow.add("second", "wc-plain", {}, key="k", unique=timedelta(minutes=10))
    run = workflow.enqueue()
    message = Message.objects.get()
    assert step_header(message.headers) == (run.pk, "first")
    steps = {s["name"]: (s["state"], s["reason"]) for s in Workflow.status(run.pk)["steps"]}
    assert steps == {
        "first": ("enqueued", ""),
        "second": ("cancelled", f"not enqueued: key 'k' is held by live message {message.pk}"),
    }


def test_set_aside_messages_of_two_kinds_of_one_group_come_back_together(compose_queues):
    # wc-groups: GROUP_CONCURRENCY 1, and 1 for the kind "solo": one message of each may run in a group at once.
    django_dbqueue.enqueue("wc-groups", {"n": "a"}, group="g1")
    django_dbqueue.enqueue("wc-groups", {"n": "t"}, group="g1", kind="solo")
    running = django_dbqueue.claim("wc-groups", 2)
    assert len(running) == 2
    django_dbqueue.enqueue("wc-groups", {"n": "b"}, group="g1")
    django_dbqueue.enqueue("wc-groups", {"n": "u"}, group="g1", kind="solo")
    assert django_dbqueue.claim("wc-groups", 2) == []  # both held back: set aside
    assert django_dbqueue.ack_many(running) == [True, True]
    claimed = django_dbqueue.claim("wc-groups", 2)  # without the set-aside (no claim above) it takes both
    assert sorted(m.payload["n"] for m in claimed) == ["b", "u"]


def test_a_claim_on_a_per_group_rate_queue_takes_every_scope_with_budget(compose_queues):
    first = django_dbqueue.enqueue("wc-rate-group", {"n": 1})
    django_dbqueue.enqueue("wc-rate-group", {"n": 2})  # no group, as the first: one budget of 1 a minute
    other = django_dbqueue.enqueue("wc-rate-group", {"n": 3}, group="g")  # a group of its own, its budget unused
    claimed = django_dbqueue.claim("wc-rate-group", 2)
    assert sorted(m.pk for m in claimed) == [first.pk, other.pk]
