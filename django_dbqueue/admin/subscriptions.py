"""Topic subscriptions in the admin: the table's rows, editable; those of the TOPICS setting shown as such."""

from __future__ import annotations

from django.contrib import admin

from ..conf import get_settings
from ..models import Subscription
from .base import RefusedActions


@admin.register(Subscription)
class SubscriptionAdmin(RefusedActions[Subscription]):
    """Subscriptions in the table; those of the ``TOPICS`` setting are changed in settings only."""

    list_display = ["topic", "queue", "also_in_settings", "created_at"]
    list_filter = ["topic"]
    search_fields = ["topic", "queue"]
    ordering = ["topic", "queue"]

    @admin.display(boolean=True, description="also in TOPICS setting")
    def also_in_settings(self, obj: Subscription) -> bool:
        return obj.queue in get_settings().topics.get(obj.topic, [])
