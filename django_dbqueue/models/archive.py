"""The archive: finished messages (acked, dead, expired, cancelled), history for operators and analytics."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime
from functools import partial
from typing import Any, ClassVar, Self, TypeVar, cast

from django.db import models
from django.db.models import Q

from ..db.clock import DbNow
from ..db.errors import with_retries
from ..db.transactions import write_transaction
from ..exceptions import AlreadyReplayed, DuplicateKey, InvalidOption
from ..validation import storable_result, storable_text
from .fields import NameField
from .protocols import Live, LiveMessage
from .statements import ARCHIVE_TABLE, COPIED, attribute, message_model


class Outcome(models.TextChoices):
    """How a message left the live table."""

    ACKED = "acked"
    DEAD = "dead"
    EXPIRED = "expired"
    CANCELLED = "cancelled"


REPLAYABLE = {Outcome.DEAD, Outcome.EXPIRED, Outcome.CANCELLED}


# Generic in its rows: ArchivedMessage's, and its DeadLetter proxy's.
Row = TypeVar("Row", bound="ArchivedMessage")


class ArchivedMessageQuerySet(models.QuerySet[Row]):
    def acked(self) -> Self:
        return self.filter(outcome=Outcome.ACKED)

    def dead(self) -> Self:
        return self.filter(outcome=Outcome.DEAD)

    def expired(self) -> Self:
        return self.filter(outcome=Outcome.EXPIRED)

    def cancelled(self) -> Self:
        return self.filter(outcome=Outcome.CANCELLED)

    def prunable(self, match: Q, before: datetime) -> Self:
        """The rows `prune` deletes (counted for a progress bar's total)."""
        return self.filter(match, finished_at__lt=before)

    def prune(
        self, match: Q, before: datetime, batch_size: int, on_batch: Callable[[int], object] | None = None
    ) -> int:
        """Delete rows matching ``match`` that finished before ``before``, ``batch_size`` at a time.

        Small batches, so that no statement holds locks for long. ``on_batch``
        hears how many rows each batch deleted (``reapqueue``'s progress).
        """
        old = self.prunable(match, before)
        total = 0
        while True:
            ids = list(old.order_by("finished_at").values_list("pk", flat=True)[:batch_size])
            if not ids:
                return total
            deleted = with_retries(
                self.db, partial(self.filter(pk__in=ids)._raw_delete, self.db), what="archive pruning"
            )
            total += deleted
            if on_batch is not None:
                on_batch(deleted)

    def replay(
        self,
        pk: int,
        build: Callable[[ArchivedMessage], Live],
        *,
        by: str = "",
        force: bool = False,
        then: Callable[[ArchivedMessage, Live], object] | None = None,
    ) -> Live:
        """Insert ``build(row)`` as a new live message and record the replay on archive row ``pk``.

        One transaction with the archive row locked, so two operators cannot
        both replay it. Only dead, expired or cancelled rows (never acked
        ones, forced or not), once each unless ``force``; a key that is live
        already refuses the replay. ``then(row, message)`` runs in that
        transaction once the message is in (a workflow step's reopening).
        """
        using = self.db

        def run() -> Live:
            with write_transaction(using):
                row = self.select_for_update().get(pk=pk)
                if row.outcome not in REPLAYABLE:
                    # Not even with force: force replays a row again, it never re-runs work that succeeded.
                    raise InvalidOption(
                        f"archived message {row.pk} is {row.outcome}; only dead, expired or cancelled messages "
                        "are replayed (an acked message did its work; enqueue a new one to run it again)"
                    )
                if row.replayed_at is not None and not force:
                    raise AlreadyReplayed(
                        f"archived message {row.pk} was replayed at {row.replayed_at:%Y-%m-%d %H:%M:%S} "
                        f"by {row.replayed_by or 'someone'} as message {row.replayed_as}; force=True replays it again"
                    )
                message = build(row)
                message.replay_of = row.pk
                message_model().objects.using(using).insert(message, None)
                if not message.was_created:
                    raise DuplicateKey(
                        f"key {row.key!r} is live in queue {row.queue!r} as message {message.pk}; "
                        "finish or cancel that one before replaying"
                    )
                self.filter(pk=row.pk).update(replayed_at=DbNow(), replayed_by=by, replayed_as=message.pk)
                if then is not None:
                    then(row, message)
                return message

        return with_retries(using, run, what=f"replay of archived message {pk}")

    def purge_dead(self, ids: Iterable[int]) -> int:
        """Delete dead letters for good; acked, expired and cancelled history is the reaper's to prune."""
        ids = list(ids)
        return with_retries(self.db, lambda: self.filter(pk__in=ids, outcome=Outcome.DEAD).delete()[0], what="purge")


class ArchivedMessage(models.Model):
    """A finished message: acked, dead, expired or cancelled. History for operators and analytics."""

    id = models.BigAutoField(primary_key=True)
    message_id = models.BigIntegerField(help_text="The id it had in the live table.")
    queue = NameField(max_length=64)
    kind = NameField(max_length=100, blank=True, default="")
    key = NameField(max_length=255, null=True, blank=True)  # NULL keys never collide
    group = NameField(max_length=255, null=True, blank=True, db_column="group_key")
    payload = models.JSONField()
    headers = models.JSONField(default=dict, blank=True)
    priority = models.SmallIntegerField(default=0)
    created_at = models.DateTimeField(help_text="Enqueue time.")
    first_available_at = models.DateTimeField()
    claimed_at = models.DateTimeField(null=True, blank=True, help_text="The last claim.")
    finished_at = models.DateTimeField()
    expires_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    max_attempts = models.PositiveSmallIntegerField(null=True, blank=True)
    deferrals = models.PositiveIntegerField(default=0, db_default=0, help_text="Times it was put off (Defer, snooze).")
    outcome = models.CharField(max_length=16, choices=Outcome.choices)
    finished_by = models.CharField(max_length=255, blank=True, default="", help_text="The worker that finished it.")
    last_error = models.TextField(blank=True, default="")
    result = models.JSONField(null=True, blank=True, help_text="What the handler returned, when it was JSON.")
    replay_of = models.BigIntegerField(null=True, blank=True, help_text="The archived message this one replayed.")
    replayed_at = models.DateTimeField(null=True, blank=True)
    replayed_by = models.CharField(max_length=150, blank=True, default="")
    replayed_as = models.BigIntegerField(null=True, blank=True, help_text="The id of the new message the replay made.")
    progress = models.JSONField(null=True, blank=True, help_text="The handler's last progress report.")
    meta = models.JSONField(null=True, blank=True, help_text="What the handler recorded with update_meta().")

    objects = ArchivedMessageQuerySet.as_manager()

    class Meta:
        app_label = "django_dbqueue"
        db_table = ARCHIVE_TABLE
        ordering = ["-finished_at", "-id"]
        indexes = [
            models.Index(fields=["queue", "outcome", "finished_at"], name="dbqueue_arc_queue_outcome"),
            # Serves the archive's list (ORDER BY finished_at DESC, id DESC, read
            # backwards; PostgreSQL needs the id in the index to skip the sort)
            # and the reaper's pruning by finished_at.
            models.Index(fields=["finished_at", "id"], name="dbqueue_arc_finished_id"),
            models.Index(fields=["message_id"], name="dbqueue_arc_message"),
            # Serves the dead letters' list: WHERE outcome = 'dead' ORDER BY
            # finished_at DESC, id DESC, read backwards in index order.
            models.Index(fields=["outcome", "finished_at", "id"], name="dbqueue_arc_outcome_finished"),
            # The reaper's pruning of one queue by its own RETENTION_DAYS.
            models.Index(fields=["queue", "finished_at"], name="dbqueue_arc_queue_finished"),
            # The admin's exact search by key.
            models.Index(fields=["key"], name="dbqueue_arc_key"),
        ]
        permissions = [("replay_archivedmessage", "Can replay dead letters")]

    def __str__(self) -> str:
        return storable_text(f"{self.queue}#{self.message_id} {self.outcome}")

    @classmethod
    def from_live(
        cls, message: LiveMessage, outcome: str, *, worker: str = "", error: str | None = None, result: Any = None
    ) -> ArchivedMessage:
        """The archive row for ``message`` finishing with ``outcome`` (unsaved; finished now by the database clock).

        Text the queue writes (the error) is made storable; a result that
        cannot be stored is not kept, and the row's error says why.
        """
        kept, why = storable_result(result)
        error = message.last_error if error is None else error
        if why is not None:
            error = f"{error}\nresult not kept: {why}".strip()
        copied = {attribute(column): getattr(message, attribute(column)) for column in COPIED}
        held = getattr(message, "held_priority", None)
        if held is not None:  # set aside by flow control when it ended (cancelled, expired): its own priority
            copied["priority"] = held
        return cls(
            message_id=message.pk,
            **{**copied, "last_error": storable_text(error)},
            finished_at=DbNow(),
            outcome=outcome,
            finished_by=worker or message.claimed_by,
            result=kept,
        )


# A named base, so that django-stubs types the manager's queryset methods.
BaseDeadLetterManager = models.Manager.from_queryset(ArchivedMessageQuerySet)


class DeadLetterManager(BaseDeadLetterManager["DeadLetter"]):
    def get_queryset(self) -> ArchivedMessageQuerySet[DeadLetter]:
        # from_queryset() makes get_queryset() return an ArchivedMessageQuerySet; django-stubs says QuerySet.
        return cast("ArchivedMessageQuerySet[DeadLetter]", super().get_queryset()).dead()


class DeadLetter(ArchivedMessage):
    """The archive's dead rows, on their own: what operators inspect, edit, replay and purge."""

    objects: ClassVar[DeadLetterManager] = DeadLetterManager()

    class Meta:
        app_label = "django_dbqueue"
        proxy = True
        verbose_name = "dead letter"

    def __str__(self) -> str:
        return storable_text(f"{self.queue}#{self.message_id} dead")
