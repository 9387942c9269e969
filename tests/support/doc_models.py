"""Plain models of what the docs promise, shared by the stateful property tests.

`Rules`: a queue's flow rules as docs/flow-control.md states them.
`RunModel`, `doom` and `propagate`: a workflow's join as docs/workflows.md
("Policies") states it. Each machine keeps its own model of a message and of
a step (they check different things); what the docs say once is written once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from django_dbqueue.conf import queue_options

# A settled step, as the join sees it: (name, outcome, the step that doomed it or None).
Settled = tuple[str, str, str | None]


@dataclass
class Rules:
    """A queue's flow-control rules, read from its settings."""

    group_limit: int | None
    kind_limits: dict[str, int]
    ordered: bool
    rate: tuple[int, int, bool] | None  # (count, period seconds, per group)

    @classmethod
    def of(cls, queue: str) -> Rules:
        options = queue_options(queue)
        rate = options.rate_limit
        return cls(
            options.group_concurrency,
            dict(options.kind_group_concurrency),
            options.ordered,
            None if rate is None else (rate.count, int(rate.seconds), rate.per_group),
        )

    def limit_of(self, kind: str) -> tuple[str, int | None]:
        """The class of ``kind`` within a group (its own, or the others') and that class's limit."""
        if kind in self.kind_limits:
            return kind, self.kind_limits[kind]
        return "", self.group_limit

    def back(self) -> int:
        """How many of a group's oldest set-aside messages a claim looks at to bring back (docs/flow-control.md,
        "Held-back messages are set aside"): as many as the group may run at once, at most 10."""
        if self.ordered:
            return 1
        at_once = (self.group_limit or 10) + sum(self.kind_limits.values())
        if self.rate is not None and self.rate[2]:
            at_once = min(at_once, self.rate[0])
        return max(1, min(at_once, 10))


@dataclass
class RunModel:
    id: int
    steps: dict[str, Any]  # a machine's step models, in dependency order: a step's parents come before it
    open: int
    positions: dict[str, int] = field(default_factory=dict)  # the order the steps were declared in
    failed: int = 0
    cancelled: bool = False

    def state(self) -> str:
        return "finished" if self.open == 0 else "running"

    def outcome(self) -> str:
        if self.cancelled:
            return "cancelled"
        if self.open:
            return ""
        return "failed" if self.failed else "succeeded"


def claimable(
    rules: Rules,
    mine: list[Any],
    limit: int,
    *,
    ready: Callable[[Any], bool],
    in_flight: Callable[[Any], bool],
    claim_order: Callable[[Any], Any],
    fifo_order: Callable[[Any], Any],
    used: Callable[[str], int],
    aside: frozenset[int] = frozenset(),
) -> tuple[list[Any], set[int]]:
    """What a claim of ``limit`` may take of a queue's live messages ``mine`` under ``rules``
    (docs/flow-control.md): the greedy pick in claim order, and every id a rule lets through now.

    ``used(scope)``: the rate's uses in the period of a scope (a group, or
    ``""``). ``aside``: the messages set aside before the claim; of each
    group's (and of the messages of no group) the claim brings back the
    oldest `Rules.back` (a FIFO group's in its order) that the rules let
    through, and the others stay out of its reach.
    """
    heads: dict[str, Any] = {}
    running: dict[tuple[str, str], int] = {}
    for m in mine:
        if m.group is not None:
            heads[m.group] = min(heads.get(m.group, fifo_order(m)), fifo_order(m))
            if in_flight(m):
                cls = rules.limit_of(m.kind)[0]
                running[(m.group, cls)] = running.get((m.group, cls), 0) + 1
    budget: dict[str, int] = {}

    def scope(m: Any) -> str:
        return (m.group or "") if rules.rate is not None and rules.rate[2] else ""

    def fits(m: Any, taken: dict[tuple[str, str], int], spent: dict[str, int]) -> bool:
        if rules.ordered and m.group is not None and heads[m.group] != fifo_order(m):
            return False
        if m.group is not None:
            cls, lim = rules.limit_of(m.kind)
            if lim is not None and running.get((m.group, cls), 0) + taken.get((m.group, cls), 0) >= lim:
                return False
        if rules.rate is None:
            return True
        if scope(m) not in budget:
            budget[scope(m)] = rules.rate[0] - used(scope(m))
        return budget[scope(m)] - spent.get(scope(m), 0) > 0

    waiting = sorted((m for m in mine if ready(m)), key=claim_order)
    scopes: dict[str | None, list[Any]] = {}
    for m in sorted(waiting, key=fifo_order if rules.ordered else claim_order):
        if m.id in aside:
            scopes.setdefault(m.group, []).append(m)
    back = {m.id for oldest in scopes.values() for m in oldest[: rules.back()] if fits(m, {}, {})}
    candidates = [m for m in waiting if m.id not in aside or m.id in back]
    allowed = {m.id for m in candidates if fits(m, {}, {})}
    picks: list[Any] = []
    taken: dict[tuple[str, str], int] = {}
    spent: dict[str, int] = {}
    for m in candidates:
        if len(picks) == limit:
            break
        if not fits(m, taken, spent):
            continue
        picks.append(m)
        if m.group is not None:
            cls = rules.limit_of(m.kind)[0]
            taken[(m.group, cls)] = taken.get((m.group, cls), 0) + 1
        if rules.rate is not None:
            spent[scope(m)] = spent.get(scope(m), 0) + 1
    return picks, allowed


def doom(parent: str, outcome: str, cause: str | None) -> tuple[str, str]:
    """(origin, reason) of a step that ``parent``'s end cancels (docs/workflows.md, "Policies")."""
    origin = cause or parent
    return origin, f"dependency {origin!r} ended {outcome if origin == parent else 'cancelled'}"


def propagate(
    run: RunModel,
    wave: list[Settled],
    release: Callable[[RunModel, list[Any]], tuple[Iterable[Any], list[Any]]],
    cancel: Callable[[Any, str, str], None],
) -> list[Any]:
    """Decide the children of the steps settled in ``wave``, wave after wave; returns the steps enqueued.

    A child whose every dependency ended as its policy allows is ready:
    ``release(run, ready)`` enqueues them and returns (the steps refused,
    which settle as cancelled in the next wave, the steps enqueued). A child
    with a dependency that ended otherwise is doomed: ``cancel(step, origin,
    reason)`` marks it cancelled.
    """
    released: list[Any] = []
    while wave:
        outcomes = {name: (outcome, cause) for name, outcome, cause in wave}
        go: dict[str, int] = {}
        stop: dict[str, tuple[str, str]] = {}
        for parent in sorted(outcomes):
            outcome, cause = outcomes[parent]
            for child in run.steps[parent].children:
                if outcome == "acked" or outcome in run.steps[child].parents[parent]:
                    go[child] = go.get(child, 0) + 1
                else:
                    stop[child] = min(stop.get(child, doom(parent, outcome, cause)), doom(parent, outcome, cause))
        ready = []
        for name, n in go.items():
            child = run.steps[name]
            if name in stop or child.state != "waiting":
                continue
            child.pending -= n
            assert child.pending >= 0
            if child.pending == 0:
                ready.append(child)
        refused, enqueued = release(run, ready)
        released += enqueued
        wave = [(step.name, "cancelled", None) for step in refused]
        for name, (origin, reason) in sorted(stop.items()):
            child = run.steps[name]
            if child.state == "waiting":
                cancel(child, origin, reason)
                wave.append((name, "cancelled", origin))
        run.open -= len(wave)
        run.failed += len(wave)
    return released


def settle_runs(
    runs: dict[int, RunModel],
    by_run: dict[int, list[Settled]],
    propagate: Callable[[RunModel, list[Settled]], list[Any]],
) -> list[Any]:
    """Steps settled in one transaction (``by_run``: each workflow's wave): each workflow's counts, then its
    children decided by ``propagate``, one workflow after another; returns the steps enqueued."""
    released: list[Any] = []
    for run_id in sorted(by_run):
        run, wave = runs[run_id], by_run[run_id]
        run.open -= len(wave)
        run.failed += sum(1 for _, outcome, _ in wave if outcome != "acked")
        released += propagate(run, wave)
    return released
