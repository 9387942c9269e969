"""The archive's admin: every finished message, and its dead letters to replay, edit and replay, or purge."""

from __future__ import annotations

import json
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.text import capfirst

from .. import control
from ..exceptions import DbQueueError
from ..models import ArchivedMessage, DeadLetter, Message
from .base import ReadOnlyQueueAdmin, breadcrumbs, flat, full_text, pretty_json, shown
from .filters import KindFilter, QueueFilter


class EditAndReplayForm(forms.Form):
    payload = forms.CharField(widget=forms.Textarea(attrs={"rows": 16, "cols": 80}), help_text="JSON.")
    force = forms.BooleanField(required=False, help_text="Replay even if this row was replayed before.")

    def clean_payload(self) -> Any:
        text = self.cleaned_data["payload"]
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise forms.ValidationError(
                f"The payload is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}."
            ) from exc


# The columns that say which message a row of the archive (or of its dead letters) is.
IDENTITY_COLUMNS = ["id", "message_id", "queue_shown", "kind_shown", "key_shown"]


class ArchiveAdmin(ReadOnlyQueueAdmin[ArchivedMessage]):
    """History: every finished message. Replay works on dead, expired and cancelled rows."""

    list_display = [*IDENTITY_COLUMNS, "outcome", "attempts", "finished_at", "replayed"]
    list_filter = [QueueFilter, KindFilter, "outcome", "finished_at"]
    id_fields = ("id", "message_id")
    actions = ["replay", "replay_forced"]
    object_actions = {"replay": "replay", "replay-forced": "replay_forced"}
    change_form_template = "admin/django_dbqueue/archivedmessage/change_form.html"
    fields = [
        ("id", "message_id", "queue_shown", "kind_shown", "key_shown", "group"),
        ("outcome", "priority", "attempts", "max_attempts", "deferrals"),
        ("created_at", "first_available_at", "claimed_at", "finished_at", "expires_at"),
        ("finished_by", "replay_of"),
        ("replayed_at", "replayed_by", "replayed"),
        "progress_shown",
        "payload_pretty",
        "headers_pretty",
        "result_pretty",
        "meta_pretty",
        "last_error_full",
    ]
    readonly_fields = flat(fields)

    @admin.display(description="replayed as")
    def replayed(self, obj: ArchivedMessage) -> SafeString | str:
        if obj.replayed_as is None:
            return "-"
        url = reverse("admin:django_dbqueue_deadletter_follow", args=[obj.replayed_as])
        return format_html('<a href="{}">message {}</a>', url, obj.replayed_as)

    @admin.display(description="result")
    def result_pretty(self, obj: ArchivedMessage) -> SafeString:
        return pretty_json(obj.result)

    def replay_selected(self, request: HttpRequest, queryset: QuerySet[ArchivedMessage], force: bool) -> None:
        by = request.user.get_username()
        replayed = self.apply(
            request, queryset, lambda row: control.replay(row, by=by, force=force), "replayed", "Not replayed"
        )
        if len(replayed) == 1:  # linked to where it is when clicked: live, or archived once processed
            url = reverse("admin:django_dbqueue_deadletter_follow", args=[replayed[0].pk])
            self.message_user(request, format_html('New message: <a href="{}">{}</a>.', url, replayed[0].pk))

    @admin.action(description="Replay selected (new ready messages, attempts reset)", permissions=["replay"])
    def replay(self, request: HttpRequest, queryset: QuerySet[ArchivedMessage]) -> None:
        self.replay_selected(request, queryset, force=False)

    @admin.action(description="Replay selected again, even if replayed before", permissions=["replay"])
    def replay_forced(self, request: HttpRequest, queryset: QuerySet[ArchivedMessage]) -> None:
        self.replay_selected(request, queryset, force=True)

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        extra = {
            "can_replay": self.has_replay_permission(request),
            "can_purge": self.has_purge_permission(request) and self.model is DeadLetter,
            **(extra_context or {}),
        }
        return super().change_view(request, object_id, form_url, extra)


admin.site.register(ArchivedMessage, ArchiveAdmin)


@admin.register(DeadLetter)
class DeadLetterAdmin(ArchiveAdmin):
    """The archive's dead rows: inspect, edit and replay, purge."""

    list_display = [*IDENTITY_COLUMNS, "attempts", "error", "finished_at", "replayed"]
    list_filter = [QueueFilter, KindFilter, "finished_at"]
    actions = ["replay", "replay_forced", "purge"]
    object_actions = {"replay": "replay", "replay-forced": "replay_forced", "purge": "purge"}

    @admin.display(description="error")
    def error(self, obj: DeadLetter) -> str:
        lines = obj.last_error.strip().splitlines()
        return shown(lines[-1][:120]) if lines else ""

    @admin.action(description="Purge selected dead letters (delete for good)", permissions=["purge"])
    def purge(self, request: HttpRequest, queryset: QuerySet[ArchivedMessage]) -> None:
        ids = self.selected(request, queryset.values_list("pk", flat=True))
        purged = control.purge(ids, using=queryset.db)
        self.message_user(request, f"{purged} dead letter(s) purged.", messages.SUCCESS)

    def get_urls(self) -> list[URLPattern]:
        return [
            path(
                "<path:object_id>/edit-and-replay/",
                self.admin_site.admin_view(self.edit_and_replay_view),
                name="django_dbqueue_deadletter_edit_and_replay",
            ),
            path(
                "follow/<int:message_id>/",
                self.admin_site.admin_view(self.follow_view),
                name="django_dbqueue_deadletter_follow",
            ),
            *super().get_urls(),
        ]

    def edit_and_replay_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """A form with the payload as JSON; on a valid POST, replay with the corrected payload."""
        if not (self.has_view_permission(request) and self.has_replay_permission(request)):
            raise PermissionDenied
        row = self.get_object_or_404(request, object_id)
        if request.method == "POST":
            form = EditAndReplayForm(request.POST)
            if form.is_valid():
                try:
                    new = control.replay(
                        row,
                        by=request.user.get_username(),
                        payload=form.cleaned_data["payload"],
                        force=form.cleaned_data["force"],
                    )
                except DbQueueError as exc:
                    form.add_error(None, str(exc))
                else:
                    # Where the new message is when clicked: live, or archived once a worker took it.
                    url = reverse("admin:django_dbqueue_deadletter_follow", args=[new.pk])
                    self.message_user(request, format_html('Replayed as message <a href="{}">{}</a>.', url, new.pk))
                    return HttpResponseRedirect(reverse("admin:django_dbqueue_deadletter_change", args=[row.pk]))
        else:
            form = EditAndReplayForm(initial={"payload": shown(json.dumps(row.payload, indent=2, ensure_ascii=False))})
        context = {
            **self.admin_site.each_context(request),
            "title": f"Edit and replay {row}",
            "opts": self.opts,
            **breadcrumbs(
                self.opts,
                (str(capfirst(self.opts.verbose_name_plural)), reverse("admin:django_dbqueue_deadletter_changelist")),
                (str(row), reverse("admin:django_dbqueue_deadletter_change", args=[row.pk])),
                ("Edit and replay", None),
            ),
            "original": row,
            "form": form,
            "last_error": full_text(row.last_error),
            "already_replayed": row.replayed_at is not None,
        }
        return TemplateResponse(request, "admin/django_dbqueue/deadletter/edit_and_replay.html", context)

    def follow_view(self, request: HttpRequest, message_id: int) -> HttpResponse:
        """Where a message is now: live (its page) or finished (its archive rows)."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        if isinstance(Message.objects.locate(message_id), Message):
            return HttpResponseRedirect(reverse("admin:django_dbqueue_message_change", args=[message_id]))
        return HttpResponseRedirect(
            f"{reverse('admin:django_dbqueue_archivedmessage_changelist')}?message_id={message_id}"
        )
