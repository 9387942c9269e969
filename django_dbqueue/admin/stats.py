"""The hourly queue figures ``queueanalytics`` writes (QueueStat), read-only in the admin."""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from ..models import QueueStat
from .base import RefusedActions


@admin.register(QueueStat)
class QueueStatAdmin(RefusedActions[QueueStat]):
    """The figures ``queueanalytics`` computed, read-only: a re-run of a window replaces them."""

    list_display = [
        "hour",
        "queue",
        "kind",
        "enqueued",
        "acked",
        "dead",
        "expired",
        "retried",
        "wait_p50",
        "wait_p95",
        "processing_p50",
        "processing_p95",
        "throughput",
    ]
    list_filter = ["queue", "kind"]
    date_hierarchy = "hour"
    search_fields = ["queue", "kind"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: QueueStat | None = None) -> bool:
        return False
