"""Enqueue from model saves and deletes: the transactional outbox.

``enqueue_on_save(Order, queue="orders", payload=...)`` connects ``post_save``
so that saving an ``Order`` writes a message. When the queue lives on the
database the model is saved to, the message is written in the save's own
transaction: a save that rolls back never leaves a message, and one that
commits always does. When the queue lives on another database alias, the
message is written when the save's transaction commits: a rolled-back save
still leaves no message, but a crash between that commit and the insert
loses the message (see docs/transactional-enqueue.md).

``enqueue_workflow_on_save(Order, build)`` does the same for a whole
workflow that ``build(instance)`` returns (docs/workflows.md), under the
same rule: in the save's transaction when the workflow's queues live on
the instance's database, else once it commits.

``bulk_create()`` and ``QuerySet.update()`` send no ``post_save``;
`enqueue_saved` applies the rules to such rows explicitly.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from django.apps import apps
from django.db import models, transaction
from django.db.models.signals import post_delete, post_save

from . import validation
from .conf import database_for
from .exceptions import InvalidOption, UnknownOption
from .models import Message
from .operations import ENQUEUE_OPTIONS, build_message, enqueue_built

# Options a rule passes to enqueue()/publish(); each may be a value or a callable of the instance.
RULE_OPTIONS = ENQUEUE_OPTIONS - {"kind", "key"}
WHEN_SHORTCUTS = ("created", "updated")
Shortcut = Literal["created", "updated"]
EVENTS = {"save": post_save, "delete": post_delete}

Value = Any  # a value, or a callable that takes the instance and returns one


class Enqueueable(Protocol):
    """What a workflow rule's callable returns: a `django_dbqueue.Workflow` (the runtime layer above this one)."""

    def database(self, using: str | None = None) -> str: ...

    def enqueue(self, *, using: str | None = None) -> Any: ...


# (model, event, "queue:name" or "topic:name", name) -> rule
_rules: dict[tuple[type[models.Model], str, str, str], OutboxRule] = {}


@dataclass
class OutboxRule:
    """One model event that writes a message: to a queue, or to every subscriber of a topic."""

    model: type[models.Model]
    event: str  # "save" or "delete"
    queue: str | None
    topic: str | None
    payload: Value
    kind: Value = ""
    key: Value = None
    when: Callable[..., bool] | Shortcut | None = None
    options: dict[str, Value] = field(default_factory=dict)
    name: str = ""
    workflow: Callable[[Any], Enqueueable | None] | None = None  # a workflow rule: builds one per instance

    @property
    def target(self) -> str:
        if self.workflow is not None:
            return "workflow"
        return f"queue:{self.queue}" if self.queue is not None else f"topic:{self.topic}"

    @property
    def dispatch_uid(self) -> str:
        return f"django_dbqueue.outbox:{self.model._meta.label}:{self.event}:{self.target}:{self.name}"

    def applies(self, instance: models.Model, created: bool) -> bool:
        if self.when is None:
            return True
        if isinstance(self.when, str):  # a shortcut
            return created if self.when == "created" else not created
        if self.event == "delete":
            return bool(self.when(instance))
        return bool(self.when(instance, created))

    def build(self, instance: models.Model) -> tuple[list[tuple[Message, float | None]], str | None]:
        """This rule's messages for ``instance`` (unsaved) and their database; validates everything."""
        payload = _value(self.payload, instance)
        options = {name: _value(value, instance) for name, value in self.options.items()}
        options["kind"] = _value(self.kind, instance)
        options["key"] = _value(self.key, instance)
        if self.topic is not None:
            from .topics import build_copies

            return build_copies(self.topic, payload, options)
        assert self.queue is not None  # a rule names a queue or a topic
        message, delay = build_message(self.queue, payload, options)
        return [(message, delay)], database_for(self.queue, options.get("using"))

    def receive(self, sender: type[models.Model], instance: models.Model, using: str, **kwargs: Any) -> None:
        if kwargs.get("raw"):  # loaddata: fixtures are not business events
            return
        if self.applies(instance, kwargs.get("created", False)):
            if self.workflow is not None:
                self.start_workflow(instance, using)
                return
            pending, target = self.build(instance)
            _write(pending, target, using)

    def start_workflow(self, instance: models.Model, source: str) -> None:
        """Enqueue the workflow this rule builds for ``instance``: in its save's transaction, as messages are."""
        assert self.workflow is not None  # a workflow rule
        built = self.workflow(instance)
        if built is None:
            return
        if not (callable(getattr(built, "enqueue", None)) and callable(getattr(built, "database", None))):
            raise InvalidOption(
                f"the workflow rule {self.name!r} on {self.model._meta.label} returned {built!r}, not a Workflow"
            )
        if built.database() == source:
            built.enqueue()  # inside the save's transaction, when it has one
        else:
            transaction.on_commit(built.enqueue, using=source)

    def disconnect(self) -> None:
        EVENTS[self.event].disconnect(sender=self.model, dispatch_uid=self.dispatch_uid)
        _rules.pop((self.model, self.event, self.target, self.name), None)


def _value(value: Value, instance: models.Model) -> Any:
    return value(instance) if callable(value) else value


def _write(pending: list[tuple[Message, float | None]], target: str | None, source: str) -> None:
    """Insert now when the queue shares the instance's database, else when its transaction commits."""
    if not pending or target is None:
        return

    def write() -> None:
        enqueue_built(pending, target)

    if target == source:
        write()  # inside the save's transaction, when it has one
    else:
        transaction.on_commit(write, using=source)


def _check_values(target: Any, payload: Value, kind: Value, key: Value, options: dict[str, Value]) -> None:
    """Refuse a rule's bad values at registration, by the checks every message passes (``build_message``).

    Values given as callables are checked when the instance gives them,
    at the save. A callable ``key`` stands in as a placeholder, so that a
    ``unique`` or ``debounce`` with it is checked too.
    """
    fixed = {name: value for name, value in options.items() if not callable(value)}
    fixed["kind"] = "" if callable(kind) else kind
    fixed["key"] = "key" if callable(key) else key
    build_message(target, {} if callable(payload) else payload, fixed)


def _model(model: type[models.Model] | str) -> type[models.Model]:
    if isinstance(model, str):
        try:
            return apps.get_model(model)
        except (LookupError, ValueError) as exc:
            raise InvalidOption(f"no model {model!r}: give a model class or an 'app_label.ModelName' label") from exc
    if not (isinstance(model, type) and issubclass(model, models.Model)):
        raise InvalidOption(f"model must be a Django model class or an 'app_label.ModelName' label, not {model!r}")
    return model


def _register(
    model: type[models.Model] | str,
    event: str,
    *,
    queue: str | None = None,
    topic: str | None = None,
    payload: Value,
    kind: Value = "",
    key: Value = None,
    when: Callable[..., bool] | Shortcut | None = None,
    name: str = "",
    options: dict[str, Value],
    workflow: Callable[[Any], Enqueueable | None] | None = None,
) -> OutboxRule:
    model = _model(model)
    if workflow is not None:
        if not callable(workflow):
            raise InvalidOption(f"workflow must be a callable that takes the instance, not {workflow!r}")
    elif queue is not None:
        validation.validate_queue_name(queue)
    else:
        validation.validate_topic_name(topic)
    unknown = set(options) - RULE_OPTIONS
    if unknown:
        raise UnknownOption(
            f"unknown option(s) {', '.join(sorted(map(repr, unknown)))}; "
            f"known: payload, kind, key, when, name, {', '.join(sorted(RULE_OPTIONS))}"
        )
    if workflow is None:
        _check_values(queue if queue is not None else topic, payload, kind, key, options)
    if not (when is None or callable(when) or (event == "save" and when in WHEN_SHORTCUTS)):
        shortcuts = f', "{WHEN_SHORTCUTS[0]}", "{WHEN_SHORTCUTS[1]}"' if event == "save" else ""
        raise InvalidOption(f"when must be None, a callable{shortcuts}; not {when!r}")
    if not isinstance(name, str):
        raise InvalidOption(f"name must be a string, not {type(name).__name__}")
    rule = OutboxRule(model, event, queue, topic, payload, kind, key, when, dict(options), name, workflow)
    previous = _rules.get((model, event, rule.target, name))
    if previous is not None:  # registering again (a module imported twice, a test) replaces the rule
        previous.disconnect()
    EVENTS[event].connect(rule.receive, sender=model, weak=False, dispatch_uid=rule.dispatch_uid)
    _rules[(model, event, rule.target, name)] = rule
    return rule


def enqueue_on_save(
    model: type[models.Model] | str,
    queue: str,
    *,
    payload: Value,
    kind: Value = "",
    key: Value = None,
    when: Callable[[Any, bool], bool] | Shortcut | None = None,
    name: str = "",
    **options: Value,
) -> OutboxRule:
    """Enqueue a message on ``queue`` each time an instance of ``model`` is saved.

    ``payload``, ``kind``, ``key`` and the other options of
    `enqueue` are values or callables taking the
    instance. ``when`` filters: ``"created"``, ``"updated"`` or a callable
    ``when(instance, created)``. Registering the same model, queue and
    ``name`` again replaces the rule. Returns the rule (``.disconnect()``).
    """
    return _register(
        model, "save", queue=queue, payload=payload, kind=kind, key=key, when=when, name=name, options=options
    )


def enqueue_on_delete(
    model: type[models.Model] | str,
    queue: str,
    *,
    payload: Value,
    kind: Value = "",
    key: Value = None,
    when: Callable[[Any], bool] | None = None,
    name: str = "",
    **options: Value,
) -> OutboxRule:
    """Enqueue a message on ``queue`` each time an instance of ``model`` is deleted.

    Like `enqueue_on_save`; ``when(instance)`` takes the instance only.
    Deletes always run in a transaction, so the message commits or rolls
    back with the delete.
    """
    return _register(
        model, "delete", queue=queue, payload=payload, kind=kind, key=key, when=when, name=name, options=options
    )


def publish_on_save(
    model: type[models.Model] | str,
    topic: str,
    *,
    payload: Value,
    kind: Value = "",
    key: Value = None,
    when: Callable[[Any, bool], bool] | Shortcut | None = None,
    name: str = "",
    **options: Value,
) -> OutboxRule:
    """Like `enqueue_on_save`, but publish to ``topic``: a copy in each subscribed queue."""
    return _register(
        model, "save", topic=topic, payload=payload, kind=kind, key=key, when=when, name=name, options=options
    )


def publish_on_delete(
    model: type[models.Model] | str,
    topic: str,
    *,
    payload: Value,
    kind: Value = "",
    key: Value = None,
    when: Callable[[Any], bool] | None = None,
    name: str = "",
    **options: Value,
) -> OutboxRule:
    """Like `enqueue_on_delete`, but publish to ``topic``."""
    return _register(
        model, "delete", topic=topic, payload=payload, kind=kind, key=key, when=when, name=name, options=options
    )


def enqueue_workflow_on_save(
    model: type[models.Model] | str,
    workflow: Callable[[Any], Enqueueable | None],
    *,
    when: Callable[[Any, bool], bool] | Shortcut | None = None,
    name: str = "",
) -> OutboxRule:
    """Enqueue the workflow ``workflow(instance)`` returns (None: none) each time an instance is saved.

    In the save's transaction: a rolled-back save writes no workflow.
    ``when`` and ``name`` as for `enqueue_on_save`. Give the workflow a key
    (``Workflow(name, key=...)``) to enqueue it once per instance however
    often it is saved.
    """
    return _register(model, "save", payload=None, when=when, name=name, options={}, workflow=workflow)


def enqueue_workflow_on_delete(
    model: type[models.Model] | str,
    workflow: Callable[[Any], Enqueueable | None],
    *,
    when: Callable[[Any], bool] | None = None,
    name: str = "",
) -> OutboxRule:
    """Like `enqueue_workflow_on_save`, on deletes (``when(instance)`` takes the instance only)."""
    return _register(model, "delete", payload=None, when=when, name=name, options={}, workflow=workflow)


def rules_for(model: type[models.Model], event: str = "save") -> list[OutboxRule]:
    """The rules registered for ``model``'s saves (or deletes), in registration order."""
    return [rule for (m, e, _, _), rule in _rules.items() if m is model and e == event]


def enqueue_saved(instances: Iterable[models.Model], *, created: bool = False) -> list[Message]:
    """Apply the save rules to rows saved without ``post_save`` (``bulk_create``, ``update()``).

    Call it in the same ``transaction.atomic()`` as the write, with the rows
    as they are now and ``created`` saying whether they are new. Messages
    for one database go in multi-row inserts. Returns the messages written
    now (those for a queue on another database are written on commit).
    """
    pending: dict[tuple[str, str], list[tuple[Message, float | None]]] = defaultdict(list)
    for instance in instances:
        source = instance._state.db or "default"
        for rule in rules_for(type(instance), "save"):
            if rule.applies(instance, created) and rule.workflow is not None:
                rule.start_workflow(instance, source)
            elif rule.applies(instance, created):
                built, target = rule.build(instance)
                if target is not None:
                    pending[(target, source)].extend(built)
    written: list[Message] = []
    for (target, source), batch in pending.items():
        if target == source:
            messages = enqueue_built(batch, target)
            written += messages
        else:
            _write(batch, target, source)
    return written
