"""The hot table: live messages (ready, scheduled, in flight), and every statement on it.

A finished message leaves this table for the archive in the same
transaction as its acknowledgement, so the table's size is the backlog.
Each rule of the lifecycle (docs/design.md) is written once, in the module
of its role, which `MessageQuerySet` is composed of: the states and the
lease guard (`states`), inserting (`inserting`), changes under a lease
(`leasing`), moving to the archive (`finishing`), the claim (`claiming`).
Those modules sit below this one and never import it, not even for their
annotations: they name a message `protocols.LiveMessage`, and their
querysets are generic in its `protocols.Live`, bound to `Message` here.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any, Self

from django.db import models
from django.db.models.base import ModelState

from .. import validation
from ..conf import queue_options
from . import workflows
from .claiming import Claimed, Claiming, default_worker_name
from .consuming import ConsumerActions
from .fields import NameField
from .inserting import ENQUEUE_OPTIONS, build_unsaved, message_headers
from .reporting import HandlerReports
from .statements import MESSAGE_TABLE, without_init
from .states import MessageState, StateAnnotations, exhausted, held_token, lease_held, state_filters

# Defined by the modules the queryset is made of, and imported from here by the package.
__all__ = [
    "ENQUEUE_OPTIONS",
    "Claimed",
    "Message",
    "MessageManager",
    "MessageQuerySet",
    "MessageState",
    "StateAnnotations",
    "build_message",
    "default_worker_name",
    "exhausted",
    "held_token",
    "lease_held",
    "message_headers",
    "state_filters",
]


class MessageQuerySet(Claiming["Message"]):
    """Querysets whose methods name the states of the lifecycle: reads, inserts, leases, finishes, and the claim."""


def build_message(queue: str, payload: Any, options: dict[str, Any]) -> tuple[Message, float | None]:
    """Validate one message's options and build it, an unsaved `Message`; see `inserting.build_unsaved`."""
    return build_unsaved(Message, queue, payload, options)


# A message with every field at its default, per model class, that Message.unsaved() copies.
_BLANK: dict[type[Message], Message] = {}

# A named base, so that django-stubs types the manager's queryset methods.
BaseMessageManager = models.Manager.from_queryset(MessageQuerySet)


class MessageManager(BaseMessageManager["Message"]):
    """``Message.objects``: every statement on the live table, also after ``.using(alias)``."""


class Message(ConsumerActions, HandlerReports, models.Model):
    """A live message: ready, scheduled or in flight."""

    id = models.BigAutoField(primary_key=True)
    queue = NameField(max_length=64)
    kind = NameField(max_length=100, blank=True, default="", db_default="")
    key = NameField(max_length=255, null=True, blank=True)  # NULL keys never collide
    # GROUP is a reserved word in SQL: the column is group_key, so plain SQL need not quote it.
    group = NameField(  # NULL: in no group
        max_length=255, null=True, blank=True, db_column="group_key", help_text="Flow control's group (a customer)."
    )
    payload = models.JSONField()
    headers = models.JSONField(default=dict, blank=True)
    priority = models.SmallIntegerField(default=0, db_default=0, help_text="Smaller runs first.")
    available_at = models.DateTimeField(help_text="Claimable from this time; a claim pushes it to the lease's end.")
    first_available_at = models.DateTimeField(help_text="When it first became available; retries keep it.")
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField(null=True, blank=True)
    lease_token = models.CharField(max_length=32, null=True, blank=True)  # noqa: DJ001 (NULL: not leased)
    claimed_by = models.CharField(max_length=255, blank=True, default="", db_default="")
    claimed_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0, db_default=0)
    max_attempts = models.PositiveSmallIntegerField(
        null=True, blank=True, help_text="Empty: the queue's MAX_ATTEMPTS setting."
    )
    deferrals = models.PositiveIntegerField(
        default=0, db_default=0, help_text="Times it was put off (Defer, snooze); capped by MAX_DEFERRALS."
    )
    last_error = models.TextField(blank=True, default="", db_default="")
    replay_of = models.BigIntegerField(null=True, blank=True, help_text="The archived (dead) message this one replays.")
    cancel_requested_at = models.DateTimeField(
        null=True, blank=True, help_text="When cancel() flagged it while it ran; its worker stops it cooperatively."
    )
    # Written by the worker's heartbeat from set_progress()/update_meta(); NULL until the handler reports.
    progress = models.JSONField(null=True, blank=True, help_text="The handler's last report: done, total, note.")
    meta = models.JSONField(null=True, blank=True, help_text="What the handler recorded with update_meta().")
    # Flow control set it aside (docs/flow-control.md, "Held-back messages are set aside"): a rule held it
    # back, its priority is SET_ASIDE_PRIORITY until a claim brings it back, and this is its own. Its index
    # differs per database, so it is not in Meta.indexes (migration 0013, `db.sql.aside_index_sql`).
    held_priority = models.SmallIntegerField(
        null=True,
        blank=True,
        help_text="Set aside by flow control: its own priority, given back when a rule lets it through.",
    )

    objects = MessageManager()

    # Not columns. Set by enqueue (was_created), and by the querysets that
    # annotate them (with_state(), the claim); absent otherwise.
    _dbqueue_created: bool
    # Set by build_message from enqueue's unique= and debounce= (seconds), for insert().
    _dbqueue_window: float | None
    _dbqueue_debounce: float | None

    class Meta:
        app_label = "django_dbqueue"
        db_table = MESSAGE_TABLE
        ordering = ["priority", "available_at", "id"]
        indexes = [
            # Serves the claim: WHERE queue = ? AND available_at <= now
            # ORDER BY priority, available_at, id, walked in index order.
            models.Index(fields=["queue", "priority", "available_at", "id"], name="dbqueue_msg_claim"),
            models.Index(fields=["expires_at"], name="dbqueue_msg_expires"),
            # The reaper: leases that ran out (poison messages), and a dead worker's claims.
            models.Index(fields=["lease_token", "available_at"], name="dbqueue_msg_lease"),
            models.Index(fields=["claimed_by"], name="dbqueue_msg_claimed_by"),
            # The admin's exact search by key, in every queue.
            models.Index(fields=["key"], name="dbqueue_msg_key"),
            # Flow control: a group's oldest message (FIFO groups), a group's rows.
            models.Index(fields=["queue", "group", "id"], name="dbqueue_msg_group"),
        ]
        constraints = [
            # NULL keys never collide, so only keyed messages are deduplicated.
            models.UniqueConstraint(fields=["queue", "key"], name="dbqueue_msg_queue_key"),
        ]
        permissions = [("cancel_message", "Can cancel, run now and release live messages")]

    def __str__(self) -> str:
        # storable_text: NUL visible, as a plain SQL producer may store it in a kind
        return validation.storable_text(f"{self.queue}#{self.pk}" + (f" ({self.kind})" if self.kind else ""))

    @classmethod
    def _without_init(cls, fields: Iterable[tuple[str, Any]], db: str | None = None) -> Self:
        """A message holding ``fields``, made without Model.__init__ (`statements.without_init`)."""
        return without_init(cls, fields, db)

    @classmethod
    def unsaved(cls, **fields: Any) -> Self:
        """A new unsaved message with ``fields``, the others at their defaults: what ``Message(**fields)`` builds.

        Copies the attributes of a blank message made once. ``headers``, the
        one default that is a new object each time, gets its own.
        """
        blank = _BLANK.get(cls)
        if blank is None:
            blank = _BLANK[cls] = cls()
        message = cls._without_init(blank.__dict__.items())
        message.headers = {}
        for name, value in fields.items():
            setattr(message, name, value)
        return message

    @classmethod
    def from_row(cls, using: str, names: list[str], values: list[Any]) -> Self:
        """A message read from database ``using``, its fields ``names`` set to ``values`` (already converted)."""
        return cls._without_init(zip(names, values, strict=True), using)

    def with_payload(self, payload: Any, headers: dict[str, Any], text: str | None = None) -> Self:
        """A new unsaved message like this unsaved one, with ``payload`` (validated) and ``headers``.

        ``text``: the payload's JSON text, when the caller has checked it
        already (`validation.payload_json`). Copying the attributes skips
        Model.__init__, which was a quarter of ``enqueue_many``'s time for
        messages whose other fields are all equal.
        """
        copy = type(self).__new__(type(self))
        if text is None:
            text = validation.payload_json(payload)
        copy.__dict__.update(self.__dict__, _state=ModelState(), payload=payload, headers=headers)
        copy.keep_payload_json(text)
        return copy

    def keep_payload_json(self, text: str) -> None:
        """Keep the payload's JSON text that validation made, for the INSERT (see `payload_json`)."""
        self._dbqueue_payload_json = (self.payload, text)

    def payload_json(self) -> str:
        """The payload as the JSON text an INSERT writes: validation's text while the payload is the one it checked."""
        kept: tuple[Any, str] | None = self.__dict__.get("_dbqueue_payload_json")
        if kept is not None and kept[0] is self.payload:
            return kept[1]
        return json.dumps(self.payload)

    @property
    def was_created(self) -> bool:
        """After ``enqueue``: True if the call inserted this message, False if it found its key live."""
        return getattr(self, "_dbqueue_created", False)

    def max_attempts_allowed(self) -> int:
        """The message's own MAX_ATTEMPTS, else its queue's."""
        return self.max_attempts or queue_options(self.queue).max_attempts

    def attempts_left(self) -> bool:
        """Whether another attempt is allowed after this one.

        The one rule for "attempts used up", in Python; `exhausted` is
        the same rule in SQL, for the claim and the reaper.
        """
        return self.attempts < self.max_attempts_allowed()

    def deferral_refused(self) -> str | None:
        """Why one more deferral would pass the queue's MAX_DEFERRALS (the dead letter's reason), else None."""
        cap = queue_options(self.queue).max_deferrals
        if self.deferrals < cap:
            return None
        return f"deferred {self.deferrals} times; the queue's MAX_DEFERRALS is {cap}"

    def parent_results(self) -> dict[str, Any]:
        """A workflow step's parents' results: step name -> what its handler returned, in dependency order.

        Raises InvalidOption for a message that is no step, for a parent whose
        result was not kept, and past the bound on what flows (docs/workflows.md).
        """
        return workflows.parent_results(self._state.db or "default", self)

    def defer(self, until: datetime | None = None, *, delay: float | timedelta | None = None) -> bool:
        """Deprecated alias of `snooze` (``defer`` is also the name of Django's ``QuerySet.defer``)."""
        warnings.warn("Message.defer() is deprecated; use Message.snooze()", DeprecationWarning, stacklevel=2)
        return self.snooze(until, delay=delay)
