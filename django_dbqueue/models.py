"""The queue's tables.

``Message`` is the hot table: only live messages (ready, scheduled, in
flight), so its size is the backlog. A finished message moves to
``ArchivedMessage`` in the same transaction as its acknowledgement. Both
tables' layouts are a documented contract (docs/table-layout.md) for
producers that write plain SQL.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import models
from django.db.models import Count, Min, Q, Value
from django.db.models.functions import Coalesce

from .vendor import DbNow

if TYPE_CHECKING:
    from collections.abc import Iterable


class MessageState(models.TextChoices):
    READY = "ready"
    SCHEDULED = "scheduled"
    IN_FLIGHT = "in_flight", "in flight"


class Outcome(models.TextChoices):
    ACKED = "acked"
    DEAD = "dead"
    EXPIRED = "expired"
    CANCELLED = "cancelled"


def _exhausted(max_attempts: int) -> Q:
    """Leased, with no attempts left (``max_attempts``: the queue's default for messages that set none)."""
    return Q(lease_token__isnull=False, attempts__gte=Coalesce("max_attempts", Value(max_attempts)))


class MessageQuerySet(models.QuerySet["Message"]):
    """Querysets whose methods name the states of DESIGN.md's lifecycle.

    All states are judged by the database's clock: ``ready`` is claimable now
    (including messages whose lease ran out), ``scheduled`` waits for its time,
    ``in_flight`` is leased to a worker.
    """

    def for_queue(self, queue: str | Iterable[str]) -> MessageQuerySet:
        return self.filter(queue=queue) if isinstance(queue, str) else self.filter(queue__in=list(queue))

    def ready(self) -> MessageQuerySet:
        return self.filter(available_at__lte=DbNow())

    def scheduled(self) -> MessageQuerySet:
        return self.filter(available_at__gt=DbNow(), lease_token__isnull=True)

    def in_flight(self) -> MessageQuerySet:
        return self.filter(available_at__gt=DbNow(), lease_token__isnull=False)

    def expired(self) -> MessageQuerySet:
        return self.filter(expires_at__lte=DbNow())

    def claimable(self, max_attempts: int) -> MessageQuerySet:
        """What a claim may take now: ready, not expired, and not a poison message.

        ``max_attempts`` is the queue's default, for messages that set none. A
        message whose lease expired on its last attempt killed (or outlived)
        its worker: the reaper dead-letters it, nobody claims it again.
        """
        not_expired = Q(expires_at__isnull=True) | Q(expires_at__gt=DbNow())
        return self.ready().filter(not_expired).exclude(_exhausted(max_attempts))

    def poison(self, max_attempts: int) -> MessageQuerySet:
        """Messages whose lease ran out on their last attempt: the reaper dead-letters them."""
        return self.ready().filter(_exhausted(max_attempts))

    def counts_by_queue(self) -> dict[str, dict[str, int]]:
        """``{queue: {"ready": n, "scheduled": n, "in_flight": n}}`` in one query."""
        now = DbNow()
        rows = self.values("queue").annotate(
            ready=Count("id", filter=Q(available_at__lte=now)),
            scheduled=Count("id", filter=Q(available_at__gt=now, lease_token__isnull=True)),
            in_flight=Count("id", filter=Q(available_at__gt=now, lease_token__isnull=False)),
        )
        return {
            row["queue"]: {state: row[state] for state in ("ready", "scheduled", "in_flight")}
            for row in rows.order_by("queue")
        }

    def oldest_ready_age(self, queue: str | Iterable[str] | None = None) -> timedelta | None:
        """How long the oldest ready message has been waiting (None when none is)."""
        from .vendor import db_now

        qs = self.ready() if queue is None else self.for_queue(queue).ready()
        oldest = qs.aggregate(oldest=Min("available_at"))["oldest"]
        return None if oldest is None else max(db_now(self.db) - oldest, timedelta(0))


class MessageManager(models.Manager.from_queryset(MessageQuerySet)):  # type: ignore[misc]
    """Producers and consumers start here: enqueue, claim, acknowledge in bulk."""

    def enqueue(self, queue: str, payload: Any, **options: Any) -> Message:
        from .operations import enqueue

        options.setdefault("using", self.db if self._db else None)
        return enqueue(queue, payload, **options)

    def enqueue_many(self, queue: str, payloads: Iterable[Any], **options: Any) -> list[Message]:
        from .operations import enqueue_many

        options.setdefault("using", self.db if self._db else None)
        return enqueue_many(queue, payloads, **options)

    def claim(self, queues: str | Iterable[str], limit: int = 1, **options: Any) -> list[Message]:
        from .operations import claim

        return claim(queues, limit, **options)

    def ack_many(self, messages: Iterable[Message], **options: Any) -> list[bool]:
        from .operations import ack_many

        return ack_many(messages, **options)


class Message(models.Model):
    """A live message: ready, scheduled or in flight."""

    id = models.BigAutoField(primary_key=True)
    queue = models.CharField(max_length=64)
    kind = models.CharField(max_length=100, blank=True, default="", db_default="")
    key = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001 (NULL keys never collide)
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
    last_error = models.TextField(blank=True, default="", db_default="")
    replay_of = models.BigIntegerField(null=True, blank=True, help_text="The archived (dead) message this one replays.")

    objects = MessageManager()

    class Meta:
        db_table = "dbqueue_message"
        ordering = ["priority", "available_at", "id"]
        indexes = [
            # Serves the claim: WHERE queue = ? AND available_at <= now
            # ORDER BY priority, available_at, id, walked in index order.
            models.Index(fields=["queue", "priority", "available_at", "id"], name="dbqueue_msg_claim"),
            models.Index(fields=["expires_at"], name="dbqueue_msg_expires"),
        ]
        constraints = [
            # NULL keys never collide, so only keyed messages are deduplicated.
            models.UniqueConstraint(fields=["queue", "key"], name="dbqueue_msg_queue_key"),
        ]
        permissions = [("cancel_message", "Can cancel, run now and release live messages")]

    def __str__(self) -> str:
        return f"{self.queue}#{self.pk}" + (f" ({self.kind})" if self.kind else "")

    @property
    def was_created(self) -> bool:
        """After ``enqueue``: True if the call inserted this message, False if it found its key live."""
        return getattr(self, "_dbqueue_created", False)

    def state_at(self, now: datetime) -> str:
        if self.available_at <= now:
            return MessageState.READY
        return MessageState.IN_FLIGHT if self.lease_token else MessageState.SCHEDULED

    # Consumer operations on a claimed message; see django_dbqueue.operations.
    def ack(self, *, worker: str | None = None, result: Any = None) -> bool:
        from .operations import ack

        return ack(self, worker=worker, result=result)

    def reject(self, *, requeue: bool = True, delay: float | timedelta | None = None, reason: str = "") -> bool:
        from .operations import reject

        return reject(self, requeue=requeue, delay=delay, reason=reason)

    def fail(self, error: BaseException | str, *, retry: bool = True) -> bool:
        from .operations import fail

        return fail(self, error, retry=retry)

    def defer(self, until: datetime | None = None, *, delay: float | timedelta | None = None) -> bool:
        from .operations import defer

        return defer(self, until=until, delay=delay)

    def extend_lease(self, seconds: float | timedelta) -> bool:
        from .operations import extend_lease

        return extend_lease(self, seconds)

    def release(self) -> bool:
        from .operations import release

        return release(self)


class ArchivedMessageQuerySet(models.QuerySet["ArchivedMessage"]):
    def acked(self) -> ArchivedMessageQuerySet:
        return self.filter(outcome=Outcome.ACKED)

    def dead(self) -> ArchivedMessageQuerySet:
        return self.filter(outcome=Outcome.DEAD)

    def expired(self) -> ArchivedMessageQuerySet:
        return self.filter(outcome=Outcome.EXPIRED)

    def cancelled(self) -> ArchivedMessageQuerySet:
        return self.filter(outcome=Outcome.CANCELLED)


class ArchivedMessage(models.Model):
    """A finished message: acked, dead, expired or cancelled. History for operators and analytics."""

    id = models.BigAutoField(primary_key=True)
    message_id = models.BigIntegerField(help_text="The id it had in the live table.")
    queue = models.CharField(max_length=64)
    kind = models.CharField(max_length=100, blank=True, default="")
    key = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001 (NULL keys never collide)
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
    outcome = models.CharField(max_length=16, choices=Outcome.choices)
    finished_by = models.CharField(max_length=255, blank=True, default="", help_text="The worker that finished it.")
    last_error = models.TextField(blank=True, default="")
    result = models.JSONField(null=True, blank=True, help_text="What the handler returned, when it was JSON.")
    replay_of = models.BigIntegerField(null=True, blank=True, help_text="The archived message this one replayed.")
    replayed_at = models.DateTimeField(null=True, blank=True)
    replayed_by = models.CharField(max_length=150, blank=True, default="")
    replayed_as = models.BigIntegerField(null=True, blank=True, help_text="The id of the new message the replay made.")

    objects = ArchivedMessageQuerySet.as_manager()

    class Meta:
        db_table = "dbqueue_archive"
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
        ]
        permissions = [("replay_archivedmessage", "Can replay dead letters")]

    def __str__(self) -> str:
        return f"{self.queue}#{self.message_id} {self.outcome}"


class DeadLetterManager(models.Manager.from_queryset(ArchivedMessageQuerySet)):  # type: ignore[misc]
    def get_queryset(self) -> ArchivedMessageQuerySet:
        return super().get_queryset().dead()


class DeadLetter(ArchivedMessage):
    """The archive's dead rows, on their own: what operators inspect, edit, replay and purge."""

    objects = DeadLetterManager()

    class Meta:
        proxy = True
        verbose_name = "dead letter"

    def __str__(self) -> str:
        return f"{self.queue}#{self.message_id} dead"


class Worker(models.Model):
    """A running ``runqueueworker`` process; its heartbeat tells the reaper it is alive."""

    name = models.CharField(max_length=255, unique=True, help_text="hostname:pid:random, as written in claimed_by.")
    hostname = models.CharField(max_length=255)
    pid = models.PositiveIntegerField()
    queues = models.JSONField(default=list)
    concurrency = models.PositiveSmallIntegerField(default=1)
    started_at = models.DateTimeField()
    last_heartbeat_at = models.DateTimeField()
    processed = models.PositiveBigIntegerField(default=0)
    failed = models.PositiveBigIntegerField(default=0)

    class Meta:
        db_table = "dbqueue_worker"
        ordering = ["hostname", "pid"]

    def __str__(self) -> str:
        return self.name


class QueueStateQuerySet(models.QuerySet["QueueState"]):
    def paused_names(self) -> set[str]:
        return set(self.filter(paused=True).values_list("queue", flat=True))


class QueueState(models.Model):
    """Per-queue switches operators flip at run time (pause); absent means running."""

    queue = models.CharField(max_length=64, primary_key=True)
    paused = models.BooleanField(default=False)
    changed_at = models.DateTimeField(auto_now=True)
    changed_by = models.CharField(max_length=150, blank=True, default="")

    objects = QueueStateQuerySet.as_manager()

    class Meta:
        db_table = "dbqueue_queue_state"
        ordering = ["queue"]
        # The admin shows this model as the queues' overview page.
        verbose_name = "queue"
        permissions = [("pause_queue", "Can pause and resume queues")]

    def __str__(self) -> str:
        return f"{self.queue} ({'paused' if self.paused else 'running'})"


class Subscription(models.Model):
    """A queue subscribed to a topic: ``publish(topic, ...)`` writes a copy into each such queue.

    Subscriptions come from this table (editable in the admin) and from the
    ``TOPICS`` setting; see docs/topics.md.
    """

    topic = models.CharField(max_length=64)
    queue = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "dbqueue_subscription"
        ordering = ["topic", "queue"]
        constraints = [models.UniqueConstraint(fields=["topic", "queue"], name="dbqueue_sub_topic_queue")]

    def __str__(self) -> str:
        return f"{self.topic} -> {self.queue}"

    def clean(self) -> None:
        """Names follow the queue-name rules (the admin's form shows these errors)."""
        from django.core.exceptions import ValidationError

        from .validation import queue_name_problem

        errors = {}
        if (why := queue_name_problem(self.topic, "topic")) is not None:
            errors["topic"] = why
        if (why := queue_name_problem(self.queue)) is not None:
            errors["queue"] = why
        if errors:
            raise ValidationError(errors)


class QueueStat(models.Model):
    """Queue analytics per queue, kind and hour, written by ``manage.py queueanalytics``.

    Times are seconds. Re-running a window replaces its rows (never doubles them).
    """

    hour = models.DateTimeField(help_text="The start of the hour (UTC) these figures cover.")
    queue = models.CharField(max_length=64)
    kind = models.CharField(max_length=100, blank=True, default="")
    enqueued = models.PositiveBigIntegerField(default=0)
    acked = models.PositiveBigIntegerField(default=0)
    dead = models.PositiveBigIntegerField(default=0)
    expired = models.PositiveBigIntegerField(default=0)
    retried = models.PositiveBigIntegerField(default=0, help_text="Finished after more than one attempt.")
    wait_p50 = models.FloatField(null=True, blank=True)
    wait_p95 = models.FloatField(null=True, blank=True)
    wait_p99 = models.FloatField(null=True, blank=True)
    processing_p50 = models.FloatField(null=True, blank=True)
    processing_p95 = models.FloatField(null=True, blank=True)
    processing_p99 = models.FloatField(null=True, blank=True)
    attempts = models.JSONField(default=dict, blank=True, help_text='{"1": count, "2": count, ...}')
    top_errors = models.JSONField(default=list, blank=True, help_text="[[error type, count], ...] among dead letters")
    throughput = models.FloatField(default=0, help_text="Finished messages per second over the hour.")
    computed_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "dbqueue_queue_stat"
        ordering = ["-hour", "queue", "kind"]
        constraints = [models.UniqueConstraint(fields=["hour", "queue", "kind"], name="dbqueue_stat_hour_queue_kind")]

    def __str__(self) -> str:
        return f"{self.queue}/{self.kind or '*'} {self.hour:%Y-%m-%d %H:00}"
