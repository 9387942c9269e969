"""Per-queue tables: operators' switches, topic subscriptions, and the analytics' hourly figures."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import models

from ..db.errors import with_retries
from ..db.transactions import write_transaction
from ..validation import queue_name_problem
from .fields import NameField


class QueueStateQuerySet(models.QuerySet["QueueState"]):
    def paused_names(self) -> set[str]:
        return set(self.filter(paused=True).values_list("queue", flat=True))

    def set_paused(self, queue: str, paused: bool, by: str = "") -> QueueState:
        """Pause or resume a queue (workers stop claiming from a paused one)."""

        def run() -> QueueState:
            with write_transaction(self.db):
                return self.update_or_create(queue=queue, defaults={"paused": paused, "changed_by": by})[0]

        return with_retries(self.db, run, what="pause")


class QueueState(models.Model):
    """Per-queue switches operators flip at run time (pause); absent means running."""

    queue = NameField(max_length=64, primary_key=True)
    paused = models.BooleanField(default=False)
    changed_at = models.DateTimeField(auto_now=True)
    changed_by = models.CharField(max_length=150, blank=True, default="")

    objects = QueueStateQuerySet.as_manager()

    class Meta:
        app_label = "django_dbqueue"
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

    topic = NameField(max_length=64)
    queue = NameField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        app_label = "django_dbqueue"
        db_table = "dbqueue_subscription"
        ordering = ["topic", "queue"]
        constraints = [models.UniqueConstraint(fields=["topic", "queue"], name="dbqueue_sub_topic_queue")]

    def __str__(self) -> str:
        return f"{self.topic} -> {self.queue}"

    def clean(self) -> None:
        """Names follow the queue-name rules (the admin's form shows these errors)."""
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
    queue = NameField(max_length=64)
    kind = NameField(max_length=100, blank=True, default="")
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
        app_label = "django_dbqueue"
        db_table = "dbqueue_queue_stat"
        ordering = ["-hour", "queue", "kind"]
        constraints = [models.UniqueConstraint(fields=["hour", "queue", "kind"], name="dbqueue_stat_hour_queue_kind")]

    def __str__(self) -> str:
        return f"{self.queue}/{self.kind or '*'} {self.hour:%Y-%m-%d %H:00}"
