"""The live messages' admin: ready, scheduled and in-flight rows; run now, cancel, release."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse

from .. import control
from ..models import Message, MessageQuerySet, MessageState
from ..overview import format_age
from .base import ReadOnlyQueueAdmin, flat
from .filters import KindFilter, QueueFilter, StateFilter

if TYPE_CHECKING:
    from django_stubs_ext import WithAnnotations

    from ..models.messages import StateAnnotations


@admin.register(Message)
class MessageAdmin(ReadOnlyQueueAdmin[Message]):
    list_display = [
        "id",
        "queue_shown",
        "kind_shown",
        "key_shown",
        "state",
        "priority",
        "attempts",
        "age",
        "available_at",
    ]
    list_filter = [QueueFilter, KindFilter, StateFilter, "available_at", "created_at"]
    # Newest first, along the primary key: the claim order (priority, time)
    # has no index without a queue in front, and would sort the whole table.
    ordering = ["-id"]
    actions = ["run_now", "cancel", "release_lease"]
    object_actions = {"run-now": "run_now", "cancel": "cancel", "release": "release_lease"}
    change_form_template = "admin/django_dbqueue/message/change_form.html"
    fields = [
        ("id", "queue_shown", "kind_shown", "key_shown", "group"),
        ("state", "priority", "attempts", "max_attempts", "deferrals"),
        ("created_at", "first_available_at", "available_at", "expires_at"),
        ("claimed_by", "claimed_at", "cancel_requested_at"),
        "replay_of",
        "progress_shown",
        "payload_pretty",
        "headers_pretty",
        "meta_pretty",
        "last_error_full",
    ]
    readonly_fields = flat(fields)

    def get_queryset(self, request: HttpRequest) -> MessageQuerySet:
        # Message's default manager makes MessageQuerySets; django-stubs says QuerySet.
        return cast(MessageQuerySet, super().get_queryset(request)).with_state()

    @admin.display(description="state", ordering="current_state")
    def state(self, obj: WithAnnotations[Message, StateAnnotations]) -> str:
        return MessageState(obj.current_state).label

    @admin.display(description="age", ordering="-created_at")
    def age(self, obj: WithAnnotations[Message, StateAnnotations]) -> str:
        return format_age(obj.db_now - obj.created_at)

    @admin.action(description="Run selected messages now", permissions=["cancel"])
    def run_now(self, request: HttpRequest, queryset: QuerySet[Message]) -> None:
        self.apply(request, queryset, control.run_now, "made ready now", "In flight, left alone")

    @admin.action(
        description="Cancel selected messages (running ones: their worker stops them)", permissions=["cancel"]
    )
    def cancel(self, request: HttpRequest, queryset: QuerySet[Message]) -> None:
        by = request.user.get_username()
        results = self.apply(request, queryset, lambda m: control.cancel(m, by=by), "cancelled", "Gone already")
        requested = results.count(control.CancelResult.REQUESTED)
        if requested:
            self.message_user(
                request,
                f"{requested} of them running: cancel requested; each is archived as cancelled when its "
                "worker stops it (at its next heartbeat and the handler's next checkpoint).",
            )

    @admin.action(description="Release the lease of selected messages", permissions=["cancel"])
    def release_lease(self, request: HttpRequest, queryset: QuerySet[Message]) -> None:
        self.apply(request, queryset, control.release_lease, "released", "Not in flight")

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        extra = {"can_cancel": self.has_cancel_permission(request), **(extra_context or {})}
        return super().change_view(request, object_id, form_url, extra)
