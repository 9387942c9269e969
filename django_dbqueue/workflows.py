"""Workflows: declare steps and their dependencies, then write them all in one transaction (docs/workflows.md).

`Workflow` is a builder: `add` (and the `chain`, `group`, `chord`
shorthands, Celery's canvas) declares steps; `enqueue` checks the whole
graph and every step's options with the insert path's own checks, then
writes the workflow, its steps and edges and enqueues the root steps, all
or nothing. What happens next (the join, the policies, results) lives in
`models.workflows`, in the transactions that finish the steps' messages.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from . import validation
from .conf import database_for
from .control import cancel as cancel_message
from .db.errors import with_retries
from .db.transactions import write_transaction
from .exceptions import InvalidOption
from .models import Message, WorkflowRun
from .models import workflows as steps_table
from .models.flow import UNTIL_FINISHED
from .operations import build_message
from .schedules.spec import SCHEDULE_HEADER, SLOT_HEADER

__all__ = ["MAX_STEPS", "Dep", "Step", "Workflow", "chain", "chord", "group", "starts_workflow"]

MAX_STEPS = steps_table.MAX_STEPS
NAME_MAX_LENGTH = 200
# Options a step may not take: every step lives on the workflow's database (enqueue's using=).
REFUSED = {
    "using": "give using= to Workflow.enqueue(): every step lives on the workflow's database",
}


@dataclass(frozen=True)
class Dep:
    """A dependency with its own policy: ``after=[Dep("fetch", ignore_dead=True)]``."""

    name: str
    ignore_dead: bool = False
    ignore_cancelled: bool = False
    ignore_expired: bool = False

    def ignored(self) -> set[str]:
        return _ignored(self.ignore_dead, self.ignore_cancelled, self.ignore_expired)


class Step:
    """A step for `Workflow.chain`, `group` and `chord`: the arguments of `Workflow.add`."""

    def __init__(self, name: str, queue: str, payload: Any = None, **options: Any) -> None:
        self.name, self.queue, self.payload, self.options = name, queue, payload, options


def _ignored(dead: bool, cancelled: bool, expired: bool) -> set[str]:
    return {name for name, on in (("dead", dead), ("cancelled", cancelled), ("expired", expired)) if on}


@dataclass
class _Declared:
    name: str
    queue: str | Workflow
    payload: Any
    options: dict[str, Any]
    after: list[Dep]
    ignore: set[str]


class Workflow:
    """A graph of steps, enqueued all at once by `enqueue`.

    ``ignore_dead``, ``ignore_cancelled``, ``ignore_expired``: the policy of
    every dependency in the workflow (a step's own, or a `Dep`'s, adds to it).
    ``key``: the workflow is enqueued once per key, as long as its rows are
    kept; `enqueue` with a key already held writes nothing and returns the
    workflow that holds it (``was_created`` False).
    """

    def __init__(
        self,
        name: str,
        *,
        key: str | None = None,
        ignore_dead: bool = False,
        ignore_cancelled: bool = False,
        ignore_expired: bool = False,
    ) -> None:
        self.name = _name(name, "workflow name")
        self.key = validation.validate_key(key, "workflow key")
        self.policy = _ignored(ignore_dead, ignore_cancelled, ignore_expired)
        self._steps: list[_Declared] = []

    def __repr__(self) -> str:
        return f"<Workflow {self.name!r}: {len(self._steps)} step(s)>"

    def add(
        self,
        step_name: str,
        queue: str | Workflow,
        payload: Any = None,
        *,
        after: Iterable[str | Dep] = (),
        ignore_dead: bool = False,
        ignore_cancelled: bool = False,
        ignore_expired: bool = False,
        **options: Any,
    ) -> str:
        """Declare a step: ``payload`` enqueued on ``queue`` with ``options`` (enqueue's) once ``after`` settle.

        ``queue`` may be a whole `Workflow`: its steps are added as
        ``step_name.their_name``; its roots wait for ``after``, and a step
        after ``step_name`` waits for all of its last steps. A payload left
        out is ``{}``. Returns the name.
        """
        payload = {} if payload is None else payload
        deps = [d if isinstance(d, Dep) else Dep(d) for d in ([after] if isinstance(after, str) else after)]
        for dep in deps:
            if not isinstance(dep.name, str):
                raise InvalidOption(f"step {step_name!r}: after= takes step names or Dep(), not {dep.name!r}")
        self._steps.append(
            _Declared(step_name, queue, payload, options, deps, _ignored(ignore_dead, ignore_cancelled, ignore_expired))
        )
        return step_name

    def chain(self, *steps: Step, after: Iterable[str | Dep] = ()) -> list[str]:
        """Each step after the previous one (Celery's ``chain``); the first after ``after``."""
        names: list[str] = []
        previous: Iterable[str | Dep] = after
        for step in steps:
            names.append(self.add(step.name, step.queue, step.payload, after=previous, **step.options))
            previous = [step.name]
        return names

    def group(self, *steps: Step, after: Iterable[str | Dep] = ()) -> list[str]:
        """Steps side by side (Celery's ``group``), each after ``after``."""
        after = list(after)
        return [self.add(step.name, step.queue, step.payload, after=after, **step.options) for step in steps]

    def chord(self, header: Sequence[Step], body: Step, *, after: Iterable[str | Dep] = ()) -> list[str]:
        """A group, then ``body`` after all of it (Celery's ``chord``); ``body`` reads their results in order."""
        names = self.group(*header, after=after)
        self.add(body.name, body.queue, body.payload, after=names, **body.options)
        return [*names, body.name]

    # --- checking and writing --------------------------------------------------------

    def _flat(self, prefix: str = "", outer: list[Dep] | None = None, depth: int = 0) -> list[_Declared]:
        """The steps with sub-workflows inlined (names prefixed), dependencies on a sub-workflow made its leaves."""
        if depth > 20:
            raise InvalidOption(f"workflow {self.name!r}: sub-workflows nest more than 20 deep (one contains itself?)")
        flat: list[_Declared] = []
        leaves_of: dict[str, list[str]] = {}
        for step in self._steps:
            name = _name(step.name, "step name")
            deps: list[Dep] = []
            for dep in step.after:
                for leaf in leaves_of.get(dep.name, [dep.name]):
                    deps.append(Dep(prefix + leaf, *(s in dep.ignored() for s in ("dead", "cancelled", "expired"))))
            if isinstance(step.queue, Workflow):
                inner = step.queue._flat(f"{prefix}{name}.", deps, depth + 1)
                if not inner:
                    raise InvalidOption(f"step {name!r} is an empty workflow")
                flat.extend(inner)
                parents = {d.name for s in inner for d in s.after}
                leaves_of[name] = [s.name[len(prefix) :] for s in inner if s.name not in parents]
                continue
            ignore = step.ignore | self.policy
            flat.append(_Declared(prefix + name, step.queue, step.payload, step.options, deps, ignore))
        if outer is not None:
            inside = {s.name for s in flat}
            for s in flat:
                if not any(d.name in inside for d in s.after):
                    s.after = [*outer, *s.after]
        return flat

    def _checked(self, using: str | None) -> tuple[str, list[dict[str, Any]], list[tuple[str, str, int, str]]]:
        """The database, steps and edges to write; raises naming the first problem found."""
        flat = self._flat()
        if not flat:
            raise InvalidOption(f"workflow {self.name!r} has no steps")
        if len(flat) > MAX_STEPS:
            raise InvalidOption(f"workflow {self.name!r} has {len(flat):,} steps; the limit is {MAX_STEPS:,}")
        names: dict[str, _Declared] = {}
        for step in flat:
            if step.name in names:
                raise InvalidOption(f"workflow {self.name!r}: two steps are named {step.name!r}")
            if len(step.name) > NAME_MAX_LENGTH:
                raise InvalidOption(f"step name {step.name[:40]!r}... is longer than {NAME_MAX_LENGTH} characters")
            names[step.name] = step
        for step in flat:
            seen: set[str] = set()
            for dep in step.after:
                if dep.name not in names:
                    raise InvalidOption(f"step {step.name!r} is after {dep.name!r}, which is no step of this workflow")
                if dep.name in seen:
                    raise InvalidOption(f"step {step.name!r} lists {dep.name!r} twice in after=")
                seen.add(dep.name)
        _refuse_cycles(flat)
        database = database_for([str(s.queue) for s in flat], using)
        steps: list[dict[str, Any]] = []
        edges: list[tuple[str, str, int, str]] = []
        for step in flat:
            options = dict(step.options)
            for option, why in REFUSED.items():
                if option in options:
                    raise InvalidOption(f"step {step.name!r}: {why}")
            queue = str(step.queue)
            try:
                build_message(queue, step.payload, options)  # the insert path's own checks, in its order
            except (InvalidOption, TypeError, ValueError) as exc:
                raise type(exc)(f"step {step.name!r}: {exc}") from exc
            if database_for(queue) != database and using is None:
                raise InvalidOption(f"step {step.name!r}: queue {queue!r} lives on another database")
            for name in ("delay", "debounce"):  # kept as JSON: durations as seconds
                if options.get(name) is not None:
                    options[name] = validation.seconds(options[name], name)
            if options.get("unique") not in (None, UNTIL_FINISHED):
                options["unique"] = validation.seconds(options["unique"], "unique")
            kind = options.pop("kind", "") or ""
            steps.append(
                {
                    "name": step.name,
                    "queue": queue,
                    "kind": kind,
                    "payload": step.payload,
                    "options": options,
                    "pending": len(step.after),
                }
            )
            for position, dep in enumerate(step.after):
                ignore = ",".join(sorted(dep.ignored() | step.ignore))
                edges.append((dep.name, step.name, position, ignore))
        return database, steps, edges

    def database(self, using: str | None = None) -> str:
        """The database its steps live on (``using`` overrides): where `enqueue` writes it."""
        return database_for([str(s.queue) for s in self._flat()], using)

    def enqueue(self, *, using: str | None = None) -> WorkflowRun:
        """Check everything, then write the workflow and enqueue its root steps in one transaction, or nothing.

        Inside the caller's transaction, it commits or rolls back with it.
        """
        database, steps, edges = self._checked(using)

        def write() -> WorkflowRun:
            with write_transaction(database):
                return steps_table.create(database, self.name, sorted(self.policy), steps, edges, self.key)

        return with_retries(database, write, what=f"enqueue of workflow {self.name!r}")

    # --- a workflow once enqueued ------------------------------------------------------

    @staticmethod
    def status(workflow_id: int, *, using: str = "default") -> dict[str, Any]:
        """Its state and outcome, the count of steps per state, and each step's state, message and reason."""
        return WorkflowRun.objects.using(using).status(validation.message_id(workflow_id))

    @staticmethod
    def cancel(workflow_id: int, *, by: str = "", using: str = "default") -> int:
        """Cancel a workflow: waiting steps cancelled, queued ones archived as cancelled, running ones asked to stop.

        Returns how many live step messages it cancelled or asked to stop.
        """
        pk = validation.message_id(workflow_id)
        live = with_retries(using, lambda: steps_table.cancel_waiting(using, pk, by), what=f"cancel of workflow {pk}")
        return sum(1 for message_id in live if cancel_message(message_id, by=by, using=using))


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or not value.strip():
        raise InvalidOption(f"{what} must be a non-empty string, not {value!r}")
    if (why := validation.text_problem(value, what)) is not None:
        raise InvalidOption(why)
    return value


def _refuse_cycles(steps: list[_Declared]) -> None:
    """Kahn's order; the steps left over lie on a cycle, and one of them is named."""
    waiting = {s.name: len(s.after) for s in steps}
    children: dict[str, list[str]] = {s.name: [] for s in steps}
    for s in steps:
        for dep in s.after:
            children[dep.name].append(s.name)
    ready = [name for name, n in waiting.items() if n == 0]
    while ready:
        for child in children[ready.pop()]:
            waiting[child] -= 1
            if waiting[child] == 0:
                ready.append(child)
    stuck = sorted(name for name, n in waiting.items() if n > 0)
    if stuck:
        raise InvalidOption(f"the steps {', '.join(map(repr, stuck[:5]))} depend on each other in a cycle")


def chain(name: str, *steps: Step) -> Workflow:
    """A new workflow whose ``steps`` run one after the other."""
    workflow = Workflow(name)
    workflow.chain(*steps)
    return workflow


def group(name: str, *steps: Step) -> Workflow:
    """A new workflow whose ``steps`` run side by side."""
    workflow = Workflow(name)
    workflow.group(*steps)
    return workflow


def chord(name: str, header: Sequence[Step], body: Step) -> Workflow:
    """A new workflow: ``header`` side by side, then ``body`` with their results."""
    workflow = Workflow(name)
    workflow.chord(header, body)
    return workflow


def starts_workflow(build: Callable[[Message], Workflow | None]) -> Callable[[Message], int | None]:
    """Make ``build(message) -> Workflow`` a handler that enqueues the workflow once per message, or per slot.

    Put it under ``@handler`` (and ``@schedule``): the handler runs at least
    once, and the workflow is keyed, so a second run of the same message
    enqueues nothing. A scheduled message's key is its schedule and slot
    (``schedule:<name>@<slot>``), so one slot starts one workflow, as it
    sends one message; any other message's is its id. A workflow given its
    own key keeps it. The handler returns the workflow's id.
    """

    @functools.wraps(build)
    def start(message: Message) -> int | None:
        workflow = build(message)
        if workflow is None:
            return None
        if not isinstance(workflow, Workflow):
            raise InvalidOption(f"{build.__qualname__} returned {workflow!r}, not a Workflow (or None)")
        if workflow.key is None:
            workflow.key = message_key(message)
        return workflow.enqueue().pk

    return start


def message_key(message: Message) -> str:
    """The key of the workflow a message starts: its schedule's slot, or the message's own id."""
    headers = message.headers or {}
    if isinstance(headers.get(SCHEDULE_HEADER), str) and isinstance(headers.get(SLOT_HEADER), str):
        return f"schedule:{headers[SCHEDULE_HEADER]}@{headers[SLOT_HEADER]}"
    return f"message:{message.pk}"
