"""Workflows: steps with dependencies, and the join decided where a parent's outcome is written.

A workflow is a row (`WorkflowRun`), its steps (`WorkflowStep`: what to
enqueue once ready, a count of dependencies not yet settled) and its edges
(`WorkflowEdge`: parent -> child, with the outcomes of the parent the
child tolerates). A step's message carries the header `STEP_HEADER`; every
finishing path (`finishing`) checks it in Python and, only for a step,
calls `settle` in the transaction that archives the message. `settle`
decrements each child's count with one UPDATE ... WHERE pending > 0, and
enqueues the children that reached zero through the one insert path; the
decrement is a row update, so of two parents finishing at once the second
waits on the child's row and sees the first's count. Cost: the edges of the
finished step, never a scan of the workflow. This module sits below
`messages` and reaches the live model through `statements.message_model`.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, Self

from django.core.serializers.json import DjangoJSONEncoder
from django.db import IntegrityError, models, transaction
from django.db.models import Count, Exists, OuterRef

from .. import signals
from ..db.clock import DbNow
from ..db.cursors import Later
from ..db.errors import with_retries
from ..db.sql import insert_returns_ids
from ..db.stats import analyze_now
from ..db.transactions import after_commit, write_transaction
from ..exceptions import InvalidOption
from ..validation import json_problem, json_size_problem, storable_text
from . import events, joins
from .archive import Outcome
from .fields import NameField
from .inserting import build_unsaved
from .protocols import LiveMessage
from .statements import distinct_leading, message_model

logger = logging.getLogger("django_dbqueue")

# A step's message carries [workflow id, step name] under this header.
STEP_HEADER = "dbqueue_step"
# The most steps one workflow holds (sub-workflows counted inlined).
MAX_STEPS = 10_000
# The most bytes of JSON a step's result keeps for the steps after it.
MAX_RESULT_BYTES = 64 * 1024
# The most bytes of results one step reads from its parents (parent_results).
MAX_PARENT_RESULTS_BYTES = 1024 * 1024
IGNORABLE = (Outcome.DEAD, Outcome.CANCELLED, Outcome.EXPIRED)
# A workflow of at least this many steps refreshes PostgreSQL's statistics of the step and edge tables once
# it commits (`fresh_statistics`).
ANALYZE_STEPS = 1000


class StepState(models.TextChoices):
    WAITING = "waiting"  # dependencies not all settled
    ENQUEUED = "enqueued"  # its message is live
    ACKED = "acked"
    DEAD = "dead"
    EXPIRED = "expired"
    CANCELLED = "cancelled"


OPEN = (StepState.WAITING, StepState.ENQUEUED)


class WorkflowOutcome(models.TextChoices):
    SUCCEEDED = "succeeded"  # every step acked
    FAILED = "failed"  # some step ended dead, expired or cancelled
    CANCELLED = "cancelled"  # Workflow.cancel()


def step_of(message: LiveMessage) -> tuple[int, str] | None:
    """The (workflow id, step name) ``message`` runs, or None: a Python test, no statement, for every message."""
    return step_ref(message.headers)


def step_ref(headers: Any) -> tuple[int, str] | None:
    """The (workflow id, step name) that message headers name, or None."""
    if not headers or not isinstance(headers, dict):
        return None
    ref = headers.get(STEP_HEADER)
    if isinstance(ref, list) and len(ref) == 2 and isinstance(ref[0], int) and isinstance(ref[1], str):
        return ref[0], ref[1]
    return None


def kept_result(value: Any) -> tuple[Any, str]:
    """A step's result as kept for its children: (value, "") or (None, why it is not kept)."""
    if value is None:
        return None, ""
    why = json_problem(value, "the step's result") or json_size_problem(value, "the step's result", MAX_RESULT_BYTES)
    return (None, why) if why else (value, "")


class WorkflowRunQuerySet(models.QuerySet["WorkflowRun"]):
    def in_progress(self) -> Self:
        """Running workflows, oldest first (queuestats), by the (state, finished_at) index's first column."""
        return self.filter(state=WorkflowRun.RUNNING).order_by("created_at", "id")

    def names(self, limit: int = 100) -> set[str]:
        """The first ``limit`` workflow names (the admin's name filter), by a skip scan of the (name, created_at) index.

        One index lookup per name: PostgreSQL's ``SELECT DISTINCT`` read the
        whole table (0.1 s at 200,000 workflows, on every list page).
        """
        return set(distinct_leading(self.db, WorkflowRun._meta.db_table, "name", limit))

    def finished_before(self, before: datetime) -> Self:
        return self.filter(state=WorkflowRun.FINISHED, finished_at__lt=before)

    def prune(self, before: datetime, batch_size: int) -> int:
        """Delete finished workflows (runs, steps, edges) finished before ``before``, a batch per transaction."""
        using = self.db
        total = 0
        while True:

            def batch() -> int:
                with write_transaction(using):
                    ids = list(
                        self.finished_before(before).order_by("finished_at").values_list("pk", flat=True)[:batch_size]
                    )
                    if ids:
                        WorkflowEdge.objects.using(using).filter(workflow_id__in=ids)._raw_delete(using)
                        WorkflowStep.objects.using(using).filter(workflow_id__in=ids)._raw_delete(using)
                        self.filter(pk__in=ids)._raw_delete(using)
                    return len(ids)

            deleted = with_retries(using, batch, what="workflow pruning")
            total += deleted
            if deleted < batch_size:
                return total

    def status(self, pk: int) -> dict[str, Any]:
        """A workflow's state, outcome, counts of steps per state and each step's outcome (in declared order)."""
        run = self.get(pk=pk)
        steps = WorkflowStep.objects.using(self.db).filter(workflow_id=pk).order_by("position")
        counts = dict(steps.order_by().values_list("state").annotate(n=Count("id")).values_list("state", "n"))
        return {
            "id": run.pk,
            "name": run.name,
            "state": run.state,
            "outcome": run.outcome,
            "created_at": run.created_at,
            "finished_at": run.finished_at,
            "counts": {state: counts.get(state, 0) for state in StepState.values},
            "steps": [
                {
                    "name": s.name,
                    "queue": s.queue,
                    "state": s.state,
                    "message_id": s.message_id,
                    "reason": s.reason,
                    "result": s.result,
                }
                for s in steps
            ],
        }


class WorkflowRun(models.Model):
    """One enqueued workflow: its name, state, outcome, and counts the join keeps up to date."""

    RUNNING = "running"
    FINISHED = "finished"

    id = models.BigAutoField(primary_key=True)
    name = NameField(max_length=200)
    key = NameField(
        max_length=255, null=True, blank=True, unique=True, help_text="Enqueued once per key (Workflow(key=...))."
    )
    state = models.CharField(max_length=16, default=RUNNING)
    outcome = models.CharField(max_length=16, blank=True, default="", choices=WorkflowOutcome.choices)
    policy = models.JSONField(default=list, blank=True, help_text="Outcomes of a dependency every step tolerates.")
    open_steps = models.PositiveIntegerField(default=0, help_text="Steps waiting or enqueued.")
    failed_steps = models.PositiveIntegerField(default=0, help_text="Steps that ended dead, expired or cancelled.")
    created_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = WorkflowRunQuerySet.as_manager()
    # False when enqueue() found its key held and returned the workflow holding it.
    was_created: bool = True

    class Meta:
        app_label = "django_dbqueue"
        db_table = joins.WORKFLOW_TABLE
        indexes = [
            # The reaper's retention, and the admin's list by state.
            models.Index(fields=["state", "finished_at"], name="dbqueue_wf_state_finished"),
            models.Index(fields=["name", "created_at"], name="dbqueue_wf_name"),
        ]
        verbose_name = "workflow"
        permissions = [("cancel_workflowrun", "Can cancel workflows")]

    def __str__(self) -> str:
        return storable_text(f"workflow {self.name}#{self.pk} {self.state}")


class WorkflowStep(models.Model):
    """A step: what to enqueue once ready, its state, and how many of its dependencies are not yet settled."""

    id = models.BigAutoField(primary_key=True)
    workflow = models.ForeignKey(WorkflowRun, on_delete=models.DO_NOTHING, db_constraint=False, related_name="steps")
    name = NameField(max_length=200)
    position = models.PositiveIntegerField(help_text="Declaration order.")
    queue = NameField(max_length=64)
    kind = NameField(max_length=100, blank=True, default="")
    payload = models.JSONField(null=True)
    options = models.JSONField(default=dict, blank=True, encoder=DjangoJSONEncoder)
    state = models.CharField(max_length=16, choices=StepState.choices, default=StepState.WAITING)
    pending = models.PositiveIntegerField(default=0, help_text="Dependencies not yet settled.")
    message_id = models.BigIntegerField(null=True, blank=True)
    reason = models.TextField(blank=True, default="")
    cause = NameField(max_length=200, null=True, blank=True, help_text="The failed step that cancelled this one.")
    result = models.JSONField(null=True, blank=True)
    result_note = models.TextField(blank=True, default="", help_text="Why the result was not kept.")
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        app_label = "django_dbqueue"
        db_table = joins.STEP_TABLE
        constraints = [models.UniqueConstraint(fields=["workflow", "name"], name="dbqueue_wfstep_name")]
        indexes = [
            # The reaper's sweep: enqueued steps whose message is archived.
            models.Index(fields=["state", "message_id"], name="dbqueue_wfstep_state_msg"),
        ]

    def __str__(self) -> str:
        return storable_text(f"step {self.name} of workflow {self.workflow_id}: {self.state}")


class WorkflowEdge(models.Model):
    """Parent -> child: the child waits for the parent; ``ignore`` lists the parent's outcomes it runs after anyway."""

    id = models.BigAutoField(primary_key=True)
    workflow = models.ForeignKey(WorkflowRun, on_delete=models.DO_NOTHING, db_constraint=False, related_name="+")
    parent = NameField(max_length=200)
    child = NameField(max_length=200)
    position = models.PositiveIntegerField(help_text="The parent's place in the child's dependencies.")
    ignore = models.CharField(max_length=40, blank=True, default="")

    class Meta:
        app_label = "django_dbqueue"
        db_table = joins.EDGE_TABLE
        indexes = [
            # The join: a step's children.
            models.Index(fields=["workflow", "parent"], name="dbqueue_wfedge_parent"),
            # parent_results: a step's parents.
            models.Index(fields=["workflow", "child", "position"], name="dbqueue_wfedge_child"),
        ]

    def __str__(self) -> str:
        return storable_text(f"{self.parent} -> {self.child}")


# --- writing a workflow -----------------------------------------------------------------


def create(
    using: str,
    name: str,
    policy: Sequence[str],
    steps: Sequence[dict[str, Any]],
    edges: Sequence[tuple[str, str, int, str]],
    key: str | None = None,
) -> WorkflowRun:
    """Write a validated workflow and enqueue its root steps, in the caller's transaction.

    ``steps``: dicts of name, queue, kind, payload, options (checked by the
    insert path's `build_unsaved` already), pending. ``edges``: (parent,
    child, position, ignore). With a ``key`` another workflow holds, nothing
    is written and that workflow is returned, its ``was_created`` False: the
    unique index decides between producers racing with one key.
    """
    run = WorkflowRun(name=name, key=key, policy=list(policy), open_steps=len(steps), created_at=DbNow())
    if key is not None:
        try:
            with transaction.atomic(using=using):  # a savepoint: the caller's transaction goes on
                run.save(using=using, force_insert=True)
        except IntegrityError:
            held = WorkflowRun.objects.using(using).get(key=key)
            held.was_created = False
            return held
    else:
        run.save(using=using, force_insert=True)
    rows = [
        WorkflowStep(
            workflow_id=run.pk,
            position=n,
            **{k: step[k] for k in ("name", "queue", "kind", "payload")},
            options=step["options"],
            pending=step["pending"],
        )
        for n, step in enumerate(steps)
    ]
    WorkflowStep.objects.using(using).bulk_create(rows, batch_size=500)
    WorkflowEdge.objects.using(using).bulk_create(
        [WorkflowEdge(workflow_id=run.pk, parent=p, child=c, position=n, ignore=i) for p, c, n, i in edges],
        batch_size=500,
    )
    if len(steps) >= ANALYZE_STEPS:
        after_commit(using, lambda: fresh_statistics(using))
    roots = WorkflowStep.objects.using(using).filter(workflow_id=run.pk, pending=0).order_by("position")
    refused, _ = _enqueue_steps(using, list(roots))
    if refused:  # keyed roots whose key kept them out: settled as cancelled, their dependents decided
        _propagate(using, run.pk, [(name, Outcome.CANCELLED, None) for name in refused])
    run.refresh_from_db(using=using, fields=["created_at"])  # the database's time, not the expression that set it
    return run


def fresh_statistics(using: str) -> None:
    """ANALYZE the step and edge tables on PostgreSQL (elsewhere nothing), once a large workflow committed.

    The join reads a workflow's rows by (workflow, name) and (workflow,
    parent). For a workflow newer than the statistics, PostgreSQL expects
    one row per workflow and reads the index by the workflow alone,
    filtering the names: every batch of a 10,000-step fan-out's parents
    walked all 10,000 (3 ms instead of 0.1 ms a statement, seen in
    `queuebench --phases workflows`). Autovacuum catches up within about a
    minute when it is on; the reaper's pass, when it is off. Best effort:
    the workflow is committed; waiting longer than `ANALYZE_LOCK_TIMEOUT_MS`
    for a table's lock, or any failure, is logged and leaves it to them.
    """
    for table in (joins.STEP_TABLE, joins.EDGE_TABLE):
        try:
            analyze_now(using, table)
        except Exception as exc:
            logger.warning("could not refresh the statistics of %s after a large workflow: %s", table, exc)


def step_options(step: WorkflowStep) -> dict[str, Any]:
    """The enqueue options a step was declared with (times stored as text, read back)."""
    options = dict(step.options or {})
    for name in ("run_at", "expires_at"):
        if isinstance(options.get(name), str):
            options[name] = datetime.fromisoformat(options[name])
    return options


def _enqueue_steps(using: str, ready: Sequence[WorkflowStep]) -> tuple[list[str], list[LiveMessage]]:
    """Enqueue ``ready`` steps' messages through the one insert path and note them on the steps (the caller's
    transaction): one multi-row INSERT where the database returns its ids, else one INSERT per step.

    A keyed step whose key's rules keep its message out (the key is live,
    its unique window is open, or its debounce found the key's message
    running) is cancelled with the reason; returns the names of those steps,
    for the caller to settle their dependents, and the messages that run the
    others. A debounce that replaced the key's waiting message makes that
    message the step's.
    """
    if not ready:
        return [], []
    model = message_model()
    built = []
    for step in ready:
        options = step_options(step)
        headers = {**(options.get("headers") or {}), STEP_HEADER: [step.workflow_id, step.name]}
        built.append(build_unsaved(model, step.queue, step.payload, {**options, "kind": step.kind, "headers": headers}))
    live = model.objects.using(using)
    if len(built) > 1 and insert_returns_ids(using):
        messages = live.insert_built(built)
    else:
        messages = [live.insert_into(using, message, delay) for message, delay in built]
        events.enqueued(messages, using)
    steps = WorkflowStep.objects.using(using)
    pairs = list(zip(ready, messages, strict=True))
    kept = [(step, message) for step, message in pairs if _ours(step, message)]
    refused = [(step, _key_refusal(step, message)) for step, message in pairs if not _ours(step, message)]
    for step, reason in refused:
        steps.filter(pk=step.pk).update(state=StepState.CANCELLED, pending=0, reason=reason, finished_at=DbNow())
    if kept:
        joins.note_enqueued(using, StepState.ENQUEUED, [(step.pk, message.pk) for step, message in kept])
    return [step.name for step, _ in refused], [message for _, message in kept]


def _ours(step: WorkflowStep, message: LiveMessage) -> bool:
    """Whether the message the insert path returned for ``step`` runs it: it carries the step's own header.

    A created message does; so does the key's waiting message that a
    debounce replaced (payload and headers). A live message the key ran
    into is another's.
    """
    return message.pk is not None and step_of(message) == (step.workflow_id, step.name)


def _key_refusal(step: WorkflowStep, message: LiveMessage) -> str:
    """Why a keyed step got no message of its own (it is cancelled with this reason)."""
    key = step_options(step).get("key")
    if message.pk is None:
        return f"not enqueued: key {key!r} was taken less than its unique window ago"
    return f"not enqueued: key {key!r} is held by live message {message.pk}"


# --- the join ---------------------------------------------------------------------------

# A finished step's message: ((workflow id, step name), message id, outcome, result, reason).
Finished = tuple[tuple[int, str], int, str, Any, str]


def settle_step(using: str, ref: tuple[int, str], message_id: int, outcome: str, result: Any, reason: str) -> None:
    """`settle_many` for one step."""
    settle_many(using, [(ref, message_id, outcome, result, reason)])


def settle_many(using: str, finished: Sequence[Finished]) -> list[LiveMessage]:
    """Record how steps' messages ended and decide their dependents, in the caller's (finishing) transaction.

    Only called for messages that `step_of` says are steps. Per workflow:
    one UPDATE of the steps (one more per step with a result), then one
    wave of `_propagate` over their children, and one update of the
    workflow's counts. A step whose workflow rows are gone (pruned) is
    reported in the log, and nothing runs. Returns the messages of the steps
    this made ready (for the acknowledging worker to claim in the same
    transaction: `Claiming.ack_then_claim`).
    """
    released: list[LiveMessage] = []
    by_workflow: dict[int, list[Finished]] = defaultdict(list)
    for entry in finished:
        by_workflow[entry[0][0]].append(entry)
    for workflow_id in sorted(by_workflow):  # one lock order for every batch
        entries = by_workflow[workflow_id]
        marked = _mark(using, workflow_id, entries)
        # The children of every step are read with the steps' UPDATEs, in one round trip where the database
        # takes several statements (`cursors.grouping`): those of a step that was not settled are left out.
        children = joins.lock_children(using, workflow_id, sorted({ref[1] for ref, *_ in entries}))
        settled = marked()
        if settled:
            released += _propagate(using, workflow_id, settled, children)
    return released


def _mark(using: str, workflow_id: int, finished: Sequence[Finished]) -> Callable[[], list[tuple[str, str, None]]]:
    """Set the finished steps' outcome, result and reason (only steps still enqueued as these messages);
    returns what answers (name, outcome, None) of each step this call settled, once the UPDATEs have run
    (they are held back in a `cursors.grouping` block)."""
    plain: dict[tuple[str, str], list[Finished]] = defaultdict(list)  # no result kept: one UPDATE per outcome
    own: list[tuple[Finished, Any, str]] = []
    for entry in finished:
        _, _, outcome, result, reason = entry
        kept, why = kept_result(result) if outcome == Outcome.ACKED else (None, "")
        text = storable_text(reason)[:4000] if outcome != Outcome.ACKED else ""
        if kept is None and not why:
            plain[(outcome, text)].append(entry)
        else:
            own.append((entry, kept, why))
    groups = []
    for (outcome, text), entries in plain.items():
        pairs = [(ref[1], message_id) for ref, message_id, *_ in entries]
        changed = joins.finish_steps(using, StepState.ENQUEUED, workflow_id, pairs, outcome, text)
        groups.append((outcome, entries, changed))
    singles = []
    for entry, kept, why in own:
        (ref, message_id, outcome, _, reason) = entry
        text = storable_text(reason)[:4000] if outcome != Outcome.ACKED else ""
        pair = [(ref[1], message_id)]
        changed = joins.finish_steps(using, StepState.ENQUEUED, workflow_id, pair, outcome, text, kept, why)
        singles.append((entry, changed))

    def settled() -> list[tuple[str, str, None]]:
        names: list[tuple[str, str, None]] = []
        for outcome, entries, changed in groups:
            if changed.get() != len(entries):  # some step is no longer enqueued as this message, or its rows are gone
                ids = [message_id for _, message_id, *_ in entries]
                done = set(
                    WorkflowStep.objects.using(using)
                    .filter(workflow_id=workflow_id, message_id__in=ids, state=outcome)
                    .values_list("name", "message_id")
                )
                entries = [e for e in entries if (e[0][1], e[1]) in done or _orphan(using, e)]
            names.extend((ref[1], outcome, None) for ref, _, _, _, _ in entries)
        for (ref, message_id, outcome, _, reason), changed in singles:
            if changed.get() == 1:
                names.append((ref[1], outcome, None))
            else:
                _orphan(using, (ref, message_id, outcome, None, reason))
        return names

    return settled


def _orphan(using: str, entry: Finished) -> bool:
    """Log a step whose workflow rows are gone (nothing after it runs); always False (not settled here)."""
    (workflow_id, name), message_id, *_ = entry
    if not WorkflowStep.objects.using(using).filter(workflow_id=workflow_id, name=name).exists():
        logger.warning(
            "message %s is step %r of workflow %s, whose rows are gone: nothing after it runs",
            message_id,
            name,
            workflow_id,
        )
    return False


def _propagate(
    using: str,
    workflow_id: int,
    settled: Sequence[tuple[str, str, str | None]],
    first: Later[list[tuple[str, str, WorkflowStep]]] | None = None,
) -> list[LiveMessage]:
    """Decrement the children of the settled steps, enqueue those at zero, cancel those a failure dooms.

    In waves: the edges of the steps settled in a wave are read with
    their children, locked, in one SELECT (`joins.lock_children`), each
    child decremented by the
    number of its parents among them (a fan-in child of ten parents acked
    together loses ten at once, in one UPDATE); the steps a failure cancels
    make the next wave. A child that one parent lets go and another dooms
    in the same wave is doomed, as it would be in any order. ``first``:
    the first wave's edges, already read (with more parents, perhaps: those
    not settled are left out). Returns the messages enqueued for the steps
    made ready.
    """
    released: list[LiveMessage] = []
    closed = len(settled)
    failed = sum(1 for _, outcome, _ in settled if outcome != Outcome.ACKED)
    wave = list(settled)
    while wave:
        outcomes = {name: (outcome, cause) for name, outcome, cause in wave}
        stop: dict[str, tuple[str, str]] = {}  # child -> (origin, reason)
        go: dict[str, int] = defaultdict(int)
        locked: dict[str, WorkflowStep] = {}  # in position order
        # By the (workflow, parent) index: a fan-in child's other edges are never read.
        edges = (first or joins.lock_children(using, workflow_id, sorted(outcomes))).get()
        first = None
        for parent, ignore, step in edges:
            if parent not in outcomes:  # read with the first wave, but not settled by it
                continue
            child = locked.setdefault(step.name, step).name
            outcome, cause = outcomes[parent]
            if outcome == Outcome.ACKED or outcome in ignore.split(","):
                go[child] += 1
            else:
                doom = _doom(parent, outcome, cause)
                stop[child] = min(stop.get(child, doom), doom)
        children = [
            (step, go[name])
            for name, step in locked.items()
            if name in go and name not in stop and step.state == StepState.WAITING
        ]
        refused, enqueued = _release(using, children)
        released += enqueued
        wave = [(name, Outcome.CANCELLED, None) for name in refused]  # keys refused
        closed += len(wave)
        failed += len(wave)
        if stop:  # rare: a dependency failed for good
            steps = WorkflowStep.objects.using(using).filter(workflow_id=workflow_id)
            doomed = list(
                steps.select_for_update()
                .filter(name__in=sorted(stop), state=StepState.WAITING)
                .values_list("name", flat=True)
            )
            by_reason: dict[tuple[str, str], list[str]] = defaultdict(list)
            for name in doomed:
                by_reason[stop[name]].append(name)
            for (origin, reason), names in sorted(by_reason.items()):
                steps.filter(name__in=names, state=StepState.WAITING).update(
                    state=StepState.CANCELLED, cause=origin, reason=reason, finished_at=DbNow()
                )
                wave.extend((name, Outcome.CANCELLED, origin) for name in names)
            closed += len(doomed)
            failed += len(doomed)
    _close(using, workflow_id, closed, failed)
    return released


def _doom(parent: str, outcome: str, cause: str | None) -> tuple[str, str]:
    """(origin, reason) of a child that ``parent``'s ``outcome`` cancels: the origin is the step whose end
    began the cascade (``cause``, when the parent was itself cancelled by one), else the parent."""
    origin = cause or parent
    return origin, f"dependency {origin!r} ended {outcome if origin == parent else 'cancelled'}"


def _release(using: str, children: list[tuple[WorkflowStep, int]]) -> tuple[list[str], list[LiveMessage]]:
    """Take ``n`` settled dependencies off each locked waiting child; enqueue those left with none.

    Returns the names of those a key kept out (cancelled: `_enqueue_steps`), and the enqueued messages."""
    by_count: dict[int, list[int]] = defaultdict(list)
    ready = []
    for step, n in children:
        if step.pending <= n:
            ready.append(step)
        else:
            by_count[n].append(step.pk)
    for n, pks in sorted(by_count.items()):
        joins.take_pending(using, pks, n)
    return _enqueue_steps(using, ready)


def _close(using: str, workflow_id: int, closed: int, failed: int) -> None:
    """Count ``closed`` steps as settled (``failed`` of them not acked); the workflow finishes at zero open.

    While steps stay open, one UPDATE that leaves at least one open; the
    last steps read the row locked and finish the workflow.
    """
    if closed and joins.count_closed(using, workflow_id, closed, failed):
        return
    runs = WorkflowRun.objects.using(using)
    run = runs.select_for_update().filter(pk=workflow_id).first()
    if run is None:
        return
    left = max(run.open_steps - closed, 0)
    changes: dict[str, Any] = {"open_steps": left, "failed_steps": run.failed_steps + failed}
    if left == 0 and run.state != WorkflowRun.FINISHED:
        changes["state"] = WorkflowRun.FINISHED
        changes["finished_at"] = DbNow()
        if run.outcome != WorkflowOutcome.CANCELLED:
            changes["outcome"] = WorkflowOutcome.FAILED if changes["failed_steps"] else WorkflowOutcome.SUCCEEDED
        if signals.workflow_finished.receivers:
            outcome = changes.get("outcome", run.outcome)
            after_commit(using, lambda: _announce(using, workflow_id, run.name, outcome))
    runs.filter(pk=workflow_id).update(**changes)


def _announce(using: str, workflow_id: int, name: str, outcome: str) -> None:
    """``workflow_finished``, once durable; a receiver that raises is logged, as for the message signals."""
    for receiver, response in signals.workflow_finished.send_robust(
        sender=WorkflowRun, workflow=workflow_id, name=name, outcome=outcome, using=using
    ):
        if isinstance(response, Exception):
            logger.error(
                "receiver %s of django_dbqueue signal workflow_finished raised; the workflow stands",
                getattr(receiver, "__qualname__", receiver),
                exc_info=response,
            )


# --- orphans ----------------------------------------------------------------------------


# Set on a claimed step's message by `check_steps`: whether its step's row was there.
STEP_PRESENT = "_dbqueue_step_present"


def check_steps(using: str, messages: Sequence[LiveMessage]) -> None:
    """Look up the step rows of a claimed batch's step messages in one statement (per database, ``using``
    for a message that names none), for `orphan_reason`.

    A worker's batch of ten parents of a fan-out used to read their rows one
    message at a time before each ran: in a profile, most of the consumer
    thread's time. Any other message costs a test of its headers.
    """
    by_db: dict[str, list[tuple[LiveMessage, tuple[int, str]]]] = defaultdict(list)
    for message in messages:
        if (ref := step_of(message)) is not None:
            by_db[message._state.db or using].append((message, ref))
    for db, steps in by_db.items():
        present = joins.present_steps(db, {ref for _, ref in steps})
        for message, ref in steps:
            message.__dict__[STEP_PRESENT] = ref in present


def orphan_reason(using: str, message: LiveMessage) -> str | None:
    """Why step message ``message`` must not run: its step's rows are gone; None when they are there.

    Any other message costs a Python test of its headers, no statement; a
    step one indexed lookup (the steps' unique (workflow, name) index),
    unless its claim looked it up with its batch (`check_steps`).
    """
    ref = step_of(message)
    if ref is None:
        return None
    workflow_id, name = ref
    present = message.__dict__.get(STEP_PRESENT)
    if present is None:
        present = bool(joins.present_steps(using, {ref}))
    if present:
        return None
    return (
        f"orphaned workflow step: the rows of step {name!r} of workflow {workflow_id} are gone "
        "(deleted outside the reaper's retention); not run, nothing after it runs"
    )


# --- reading results --------------------------------------------------------------------


def _satisfied(parent_state: str, ignore: str) -> bool:
    """Whether a parent in ``parent_state`` lets its child go, under the edge's ``ignore`` list."""
    return parent_state == Outcome.ACKED or (parent_state not in OPEN and parent_state in ignore.split(","))


def parent_results(using: str, message: LiveMessage) -> dict[str, Any]:
    """Step name -> result of each step ``message``'s step depends on, in the order of its dependencies."""
    ref = step_of(message)
    if ref is None:
        raise InvalidOption(f"message {message.pk} is not a workflow step: it has no parent results")
    workflow_id, name = ref
    parents = list(
        WorkflowEdge.objects.using(using)
        .filter(workflow_id=workflow_id, child=name)
        .order_by("position")
        .values_list("parent", flat=True)
    )
    rows = {
        row[0]: row[1:]
        for row in WorkflowStep.objects.using(using)
        .filter(workflow_id=workflow_id, name__in=parents)
        .values_list("name", "result", "result_note")
    }
    results: dict[str, Any] = {}
    size = 0
    for parent in parents:
        result, note = rows.get(parent, (None, ""))
        if note:
            raise InvalidOption(f"step {parent!r} returned a result that was not kept: {note}")
        size += len(json.dumps(result))
        if size > MAX_PARENT_RESULTS_BYTES:
            raise InvalidOption(
                f"the results of step {name!r}'s parents pass {MAX_PARENT_RESULTS_BYTES:,} bytes of JSON "
                f"(at step {parent!r}); store large data elsewhere and return references"
            )
        results[parent] = result
    return results


# --- operators: cancel, replay, the reaper's sweep -------------------------------------------


def cancel_waiting(using: str, workflow_id: int, by: str) -> list[int]:
    """Cancel a workflow's waiting steps and mark it cancelled; returns the message ids of its enqueued steps.

    One transaction. A parent acked after it finds its children cancelled
    and enqueues nothing; a child enqueued before it is in the ids returned,
    for the caller to cancel as any live message.
    """
    steps = WorkflowStep.objects.using(using).filter(workflow_id=workflow_id)
    with write_transaction(using):
        waiting = list(steps.select_for_update().filter(state=StepState.WAITING).values_list("name", flat=True))
        if waiting:
            steps.filter(name__in=waiting, state=StepState.WAITING).update(
                state=StepState.CANCELLED,
                reason=f"workflow cancelled by {by}" if by else "workflow cancelled",
                finished_at=DbNow(),
            )
        runs = WorkflowRun.objects.using(using)
        if runs.select_for_update().filter(pk=workflow_id, state=WorkflowRun.RUNNING).exists():
            runs.filter(pk=workflow_id).update(outcome=WorkflowOutcome.CANCELLED)
        _close(using, workflow_id, len(waiting), len(waiting))
        enqueued: dict[int, set[str]] = defaultdict(set)
        for name, message_id in steps.filter(state=StepState.ENQUEUED).values_list("name", "message_id"):
            if message_id is not None:
                enqueued[message_id].add(name)
        # Only the messages that run this workflow's steps: a step whose waiting message another step's
        # debounce took over (maybe another workflow's) holds that message's id, and the message is the other's.
        live = message_model().objects.using(using).filter(pk__in=sorted(enqueued)).values_list("pk", "headers")
        return sorted(
            pk
            for pk, headers in live
            if (ref := step_ref(headers)) and ref[0] == workflow_id and ref[1] in enqueued[pk]
        )


def reopen(using: str, headers: Any, old_message_id: int, new_message_id: int) -> None:
    """A replay of a step's message (inside the replay's transaction): the step is enqueued again as the new
    message, and the steps its end cancelled wait again, so that the workflow continues from it.

    The cancelled steps are decided in dependency order (a step may be declared before its parents): one
    that another dependency's end still dooms stays cancelled, for that end. The parents are read locked,
    so that two replays of one workflow at once see each other's steps reopened. Every waiting child of a
    reopened step has its pending count taken again from its parents still open: one that tolerated the
    old end (or a cascade's cancel) waits for it again instead of counting its second end twice.
    """
    ref = step_ref(headers)
    if ref is None:
        return
    workflow_id, name = ref
    steps = WorkflowStep.objects.using(using).filter(workflow_id=workflow_id)
    if not steps.select_for_update().filter(name=name, message_id=old_message_id, state__in=IGNORABLE).exists():
        return
    steps.filter(name=name).update(
        state=StepState.ENQUEUED, message_id=new_message_id, reason="", result=None, finished_at=None
    )
    edges = WorkflowEdge.objects.using(using).filter(workflow_id=workflow_id)
    reopened = [name]
    # Again until a round finds no step it has not seen: another replay of this workflow may have moved a
    # step's cause to this one while this query waited for its locks (PostgreSQL picks a statement's rows
    # at its start), and a step decided before that one arrived (even one that stayed cancelled through
    # it) is decided again after it. Each round but the last sees a new step, so this ends.
    seen: set[str] = set()
    for _ in range(MAX_STEPS + 1):
        doomed = {s.name: s for s in steps.select_for_update().filter(cause=name, state=StepState.CANCELLED)}
        if not doomed.keys() - seen:
            break
        seen |= doomed.keys()
        reopened += _decide_doomed(steps, edges, doomed)
    _recount_children(steps, edges, reopened)
    runs = WorkflowRun.objects.using(using)
    run = runs.select_for_update().get(pk=workflow_id)
    runs.filter(pk=workflow_id).update(
        state=WorkflowRun.RUNNING,
        outcome="" if run.outcome != WorkflowOutcome.CANCELLED else run.outcome,
        finished_at=None,
        open_steps=run.open_steps + len(reopened),
        failed_steps=max(run.failed_steps - len(reopened), 0),
    )


def _decide_doomed(steps: Any, edges: Any, doomed: dict[str, WorkflowStep]) -> list[str]:
    """Decide the steps a replayed step's end had cancelled, in dependency order; returns those reopened.

    Their dependencies are read locked in one statement; a decision made here changes what the steps
    after it see (``ends``), and the rows are written at the end, one UPDATE per outcome.
    """
    parents_of: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for parent, child, ignore in edges.filter(child__in=sorted(doomed)).values_list("parent", "child", "ignore"):
        parents_of[child].append((parent, ignore))
    ends = _locked_ends(steps, sorted({parent for parents in parents_of.values() for parent, _ in parents}))
    reopened: list[str] = []
    kept_for: dict[tuple[str, str], list[int]] = defaultdict(list)  # (cause, reason): steps still cancelled
    waiting_on: dict[int, list[int]] = defaultdict(list)  # pending count: steps reopened
    for step in _in_dependency_order(doomed, parents_of):
        parents = parents_of[step.name]
        # Another parent that ended as it does not tolerate dooms it still: it stays cancelled, now
        # for that parent's end (whose own replay would bring it back); nothing waits for ever.
        dooms = sorted(
            _doom(parent, *ends[parent])
            for parent, ignore in parents
            if parent in ends and ends[parent][0] not in OPEN and not _satisfied(ends[parent][0], ignore)
        )
        if dooms:
            origin, reason = dooms[0]
            kept_for[(origin, reason)].append(step.pk)
            ends[step.name] = (StepState.CANCELLED, origin)
            continue
        waiting_on[sum(1 for parent, _ in parents if ends.get(parent, ("", None))[0] in OPEN)].append(step.pk)
        ends[step.name] = (StepState.WAITING, None)
        reopened.append(step.name)
    for (origin, reason), pks in sorted(kept_for.items()):
        steps.filter(pk__in=pks).update(cause=origin, reason=reason)
    for pending, pks in sorted(waiting_on.items()):
        steps.filter(pk__in=pks).update(
            state=StepState.WAITING, pending=pending, cause=None, reason="", finished_at=None
        )
    return reopened


def _in_dependency_order(
    doomed: dict[str, WorkflowStep], parents_of: dict[str, list[tuple[str, str]]]
) -> list[WorkflowStep]:
    """``doomed`` steps, each after those of them it depends on (by position among the ready ones)."""
    waiting_on = {n: {p for p, _ in parents_of[n] if p in doomed} for n in doomed}
    ordered: list[WorkflowStep] = []
    while waiting_on:
        ready = sorted((doomed[n] for n, left in waiting_on.items() if not left), key=lambda s: s.position)
        if not ready:  # cannot happen in a graph without cycles (refused at enqueue); never loop for ever
            ready = sorted((doomed[n] for n in waiting_on), key=lambda s: s.position)
        for step in ready:
            ordered.append(step)
            del waiting_on[step.name]
        for left in waiting_on.values():
            left.difference_update(s.name for s in ready)
    return ordered


def _locked_ends(steps: Any, names: list[str]) -> dict[str, tuple[str, str | None]]:
    """(state, cause) of steps ``names``, their rows locked (a replay of one of them waits, or is seen)."""
    rows = steps.select_for_update().filter(name__in=sorted(names)).order_by("position")
    return {n: (state, cause) for n, state, cause in rows.values_list("name", "state", "cause")}


def _recount_children(steps: Any, edges: Any, reopened: list[str]) -> None:
    """Take the pending count of the waiting children of ``reopened`` steps again from their parents still
    open (a waiting step's count is the number of its dependencies not yet settled)."""
    # Reopened steps too: one reopened in an early round may have a dependency that a later round reopened.
    children = set(edges.filter(parent__in=reopened).values_list("child", flat=True))
    waiting = list(
        steps.select_for_update().filter(name__in=sorted(children), state=StepState.WAITING).order_by("position")
    )
    if not waiting:
        return
    parents_of: dict[str, list[str]] = defaultdict(list)
    for parent, child in edges.filter(child__in=[s.name for s in waiting]).values_list("parent", "child"):
        parents_of[child].append(parent)
    states = dict(
        steps.filter(name__in=sorted({p for ps in parents_of.values() for p in ps})).values_list("name", "state")
    )
    changed: dict[int, list[int]] = defaultdict(list)  # pending count: the steps to set to it
    for step in waiting:
        pending = sum(1 for parent in parents_of[step.name] if states.get(parent) in OPEN)
        if pending != step.pending:
            changed[pending].append(step.pk)
    for pending, pks in sorted(changed.items()):
        steps.filter(pk__in=pks).update(pending=pending)


def unsettled(using: str, limit: int) -> list[tuple[int, str, int]]:
    """Up to ``limit`` enqueued steps whose message left the live table: (workflow id, step name, message id).

    Every finishing path settles its step in the transaction that removes
    its message; this finds what was left by a path outside them (a plain
    SQL consumer) or by a producer's debounce that replaced the step's
    waiting message. One statement, by the steps' (state, message_id) index
    and the live table's primary key.
    """
    live = message_model().objects.using(using)
    rows = (
        WorkflowStep.objects.using(using)
        .filter(state=StepState.ENQUEUED)
        .exclude(Exists(live.filter(pk=OuterRef("message_id"))))
        .order_by("message_id")
        .values_list("workflow_id", "name", "message_id")[:limit]
    )
    return [(workflow_id, name, message_id) for workflow_id, name, message_id in rows if message_id is not None]


def sweep(using: str, archive: Any, limit: int) -> int:
    """Settle enqueued steps whose message left the live table without settling them; one transaction per step.

    As the archive row says when it ran as the step; else the step is
    cancelled, naming why: its message ran as another's (a debounce with its
    key replaced the waiting message's payload and headers), or left without
    an archive row (moved to another group by a debounce, deleted, or on a
    queue with ``ARCHIVE = False``).
    """
    done = 0
    for workflow_id, name, message_id in unsettled(using, limit):
        row = archive.filter(message_id=message_id).order_by("-id").values_list("outcome", "headers", "result").first()
        if row is not None and step_ref(row[1]) == (workflow_id, name):
            outcome, result, reason = row[0], row[2], "settled by the reaper's sweep"
        elif row is not None:
            outcome, result = Outcome.CANCELLED, None
            reason = f"its message {message_id} ran as another's: an enqueue with debounce on its key replaced it"
        else:
            outcome, result = Outcome.CANCELLED, None
            reason = (
                f"its message {message_id} left the queue without an archive row "
                "(replaced by an enqueue with debounce on its key, deleted, or on a queue with ARCHIVE off)"
            )

        def run() -> None:
            with write_transaction(using):
                settle_step(using, (workflow_id, name), message_id, outcome, result, reason)  # noqa: B023

        with_retries(using, run, what="workflow sweep")
        done += 1
    return done


__all__ = [
    "MAX_STEPS",
    "STEP_HEADER",
    "StepState",
    "WorkflowEdge",
    "WorkflowOutcome",
    "WorkflowRun",
    "WorkflowStep",
]
