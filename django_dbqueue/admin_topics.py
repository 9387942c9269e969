"""The admin of topic subscriptions (registered by the app when django.contrib.admin is installed)."""

from __future__ import annotations

from django.contrib import admin

from .conf import get_settings
from .models import Subscription


class SubscriptionAdmin(admin.ModelAdmin):
    """Subscriptions in the table; those of the ``TOPICS`` setting are changed in settings only."""

    list_display = ["topic", "queue", "also_in_settings", "created_at"]
    list_filter = ["topic"]
    search_fields = ["topic", "queue"]
    ordering = ["topic", "queue"]

    @admin.display(boolean=True, description="also in TOPICS setting")
    def also_in_settings(self, obj: Subscription) -> bool:
        return obj.queue in get_settings().topics.get(obj.topic, [])


def register(site: admin.AdminSite | None = None) -> None:
    site = site or admin.site
    if not site.is_registered(Subscription):
        site.register(Subscription, SubscriptionAdmin)
