"""The operators' admin: live messages, the archive, dead letters, the queues' overview, subscriptions.

Every action calls :mod:`django_dbqueue.control` (never writes fields
itself), is a POST through the admin's CSRF-protected views, and needs its
own permission: ``cancel_message`` (cancel, run now, release),
``replay_archivedmessage`` (replay, edit and replay), ``pause_queue``
(pause, resume), ``delete_deadletter`` (purge). Seeing needs the model's
view permission. Payloads and errors are escaped wherever they are shown.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.views.decorators.http import require_POST

from . import control, handlers
from .charts import Series, hourly_bars
from .conf import get_settings
from .exceptions import DbQueueError
from .models import ArchivedMessage, DeadLetter, Message, MessageState, QueueStat, QueueState, Subscription
from .overview import build_overview, format_age
from .paginator import EstimatingPaginator

PERMISSIONS = {
    "cancel": "django_dbqueue.cancel_message",
    "replay": "django_dbqueue.replay_archivedmessage",
    "pause": "django_dbqueue.pause_queue",
    "purge": "django_dbqueue.delete_deadletter",
}


def pretty_json(value: Any) -> SafeString:
    """JSON indented in a <pre>, escaped: a payload holding markup shows as text."""
    return format_html('<pre class="dbqueue-json">{}</pre>', json.dumps(value, indent=2, ensure_ascii=False))


def flat(fields: list) -> list[str]:
    """The field names of a ``fields`` layout (rows given as tuples)."""
    return [name for item in fields for name in (item if isinstance(item, tuple) else (item,))]


def full_text(value: str) -> SafeString:
    return format_html('<pre class="dbqueue-error">{}</pre>', value) if value else SafeString("-")


# --- filters -------------------------------------------------------------------


class ValuesFilter(admin.SimpleListFilter):
    """Choices from the small live table, the settings and the handlers: never a DISTINCT over the archive.

    Any value in the URL filters, listed or not (a queue that exists only in
    the archive is reached by ``?queue=name``).
    """

    field = ""

    def known_values(self) -> set[str]:
        raise NotImplementedError

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        values = self.known_values() | set(Message.objects.values_list(self.field, flat=True).distinct())
        if self.value():
            values.add(self.value())
        return [(value, value or "(none)") for value in sorted(values)]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        return queryset if self.value() is None else queryset.filter(**{self.field: self.value()})


class QueueFilter(ValuesFilter):
    title = parameter_name = field = "queue"

    def known_values(self) -> set[str]:
        return set(get_settings().queues) | {queue for queue, _ in handlers.registered()}


class KindFilter(ValuesFilter):
    title = parameter_name = field = "kind"

    def known_values(self) -> set[str]:
        return {kind for _, kind in handlers.registered() if kind}


class StateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return list(MessageState.choices)

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        return queryset.in_state(self.value()) if self.value() in MessageState.values else queryset


# --- shared behaviour ----------------------------------------------------------


class NoEditForms:
    """Rows change only through queue operations: no add, edit or plain delete forms."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class ReadOnlyQueueAdmin(NoEditForms, admin.ModelAdmin):
    """Live and archived messages: estimated counts, escaped payloads, actions as POSTs."""

    paginator = EstimatingPaginator
    show_full_result_count = False  # a second COUNT(*) over the whole table on every filtered page
    list_per_page = 50
    # A detail page's buttons: URL name -> the list action it runs on that one row.
    object_actions: dict[str, str] = {}

    # Escaped, readable forms of the fields live and archived rows share.
    @admin.display(description="payload")
    def payload_pretty(self, obj: Message | ArchivedMessage) -> SafeString:
        return pretty_json(obj.payload)

    @admin.display(description="headers")
    def headers_pretty(self, obj: Message | ArchivedMessage) -> SafeString:
        return pretty_json(obj.headers)

    @admin.display(description="last error")
    def last_error_full(self, obj: Message | ArchivedMessage) -> SafeString:
        return full_text(obj.last_error)

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(PERMISSIONS["cancel"])

    def has_replay_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(PERMISSIONS["replay"])

    def has_purge_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(PERMISSIONS["purge"])

    def object_action_urls(self) -> list:
        """``<id>/do/<name>/``: one POST-only view for the buttons of a detail page."""
        info = self.opts.app_label, self.opts.model_name
        return [
            path(
                "<path:object_id>/do/<str:name>/",
                self.admin_site.admin_view(require_POST(self.object_action)),
                name="{}_{}_do".format(*info),
            )
        ]

    def get_object_or_404(self, request: HttpRequest, object_id: str) -> Any:
        obj = self.get_object(request, object_id)  # None for a missing or malformed id
        if obj is None:
            raise Http404(f"no {self.opts.verbose_name} with id {object_id!r}")
        return obj

    def object_action(self, request: HttpRequest, object_id: str, name: str) -> HttpResponse:
        if name not in self.object_actions:
            raise Http404(f"no action {name!r}")
        action = getattr(self, self.object_actions[name])
        allowed = [getattr(self, f"has_{p}_permission")(request) for p in action.allowed_permissions]
        if not (self.has_view_permission(request) and all(allowed)):
            raise PermissionDenied
        obj = self.get_object_or_404(request, object_id)
        action(request, self.get_queryset(request).filter(pk=obj.pk))
        return HttpResponseRedirect(self.after_object_action(request, obj))

    def after_object_action(self, request: HttpRequest, obj: Any) -> str:
        if self.get_queryset(request).filter(pk=obj.pk).exists():
            return reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_change", args=[obj.pk])
        return reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_changelist")

    def get_urls(self) -> list:
        return self.object_action_urls() + super().get_urls()

    def apply(
        self, request: HttpRequest, rows: Iterable[Any], operation: Callable[[Any], Any], done: str, skipped: str
    ) -> list[Any]:
        """Run ``operation`` on each row; tell the user what happened, naming each refusal."""
        results, refused, unchanged = [], [], []
        for row in rows:
            try:
                result = operation(row)
            except DbQueueError as exc:
                refused.append(str(exc))
                continue
            if result is False:
                unchanged.append(str(row.pk))
            else:
                results.append(result)
        if results:
            self.message_user(request, f"{len(results)} {done}.", messages.SUCCESS)
        if unchanged:
            self.message_user(request, f"{skipped}: {', '.join(unchanged)}.", messages.WARNING)
        for reason in refused:
            self.message_user(request, f"Refused: {reason}", messages.ERROR)
        return results


# --- live messages -------------------------------------------------------------


@admin.register(Message)
class MessageAdmin(ReadOnlyQueueAdmin):
    list_display = ["id", "queue", "kind", "key", "state", "priority", "attempts", "age", "available_at"]
    list_filter = [QueueFilter, KindFilter, StateFilter, "available_at", "created_at"]
    search_fields = ["=id", "=key", "payload"]
    actions = ["run_now", "cancel", "release_lease"]
    object_actions = {"run-now": "run_now", "cancel": "cancel", "release": "release_lease"}
    change_form_template = "admin/django_dbqueue/message/change_form.html"
    fields = [
        ("id", "queue", "kind", "key"),
        ("state", "priority", "attempts", "max_attempts"),
        ("created_at", "first_available_at", "available_at", "expires_at"),
        ("claimed_by", "claimed_at"),
        "replay_of",
        "payload_pretty",
        "headers_pretty",
        "last_error_full",
    ]
    readonly_fields = flat(fields)

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return super().get_queryset(request).with_state()

    @admin.display(description="state", ordering="current_state")
    def state(self, obj: Message) -> str:
        return MessageState(obj.current_state).label

    @admin.display(description="age", ordering="-created_at")
    def age(self, obj: Message) -> str:
        return format_age(obj.db_now - obj.created_at)

    @admin.action(description="Run selected messages now", permissions=["cancel"])
    def run_now(self, request: HttpRequest, queryset: QuerySet) -> None:
        self.apply(request, queryset, control.run_now, "made ready now", "In flight, left alone")

    @admin.action(description="Cancel selected messages (archived as cancelled)", permissions=["cancel"])
    def cancel(self, request: HttpRequest, queryset: QuerySet) -> None:
        by = request.user.get_username()
        self.apply(request, queryset, lambda m: control.cancel(m, by=by), "cancelled", "Gone already")

    @admin.action(description="Release the lease of selected messages", permissions=["cancel"])
    def release_lease(self, request: HttpRequest, queryset: QuerySet) -> None:
        self.apply(request, queryset, control.release_lease, "released", "Not in flight")

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: Any = None):
        extra = {"can_cancel": self.has_cancel_permission(request), **(extra_context or {})}
        return super().change_view(request, object_id, form_url, extra)


# --- the archive and its dead letters ----------------------------------------------


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


class ArchiveAdmin(ReadOnlyQueueAdmin):
    """History: every finished message. Replay works on dead, expired and cancelled rows."""

    list_display = ["id", "message_id", "queue", "kind", "key", "outcome", "attempts", "finished_at", "replayed"]
    list_filter = [QueueFilter, KindFilter, "outcome", "finished_at"]
    search_fields = ["=id", "=message_id", "=key", "payload"]
    actions = ["replay", "replay_forced"]
    object_actions = {"replay": "replay", "replay-forced": "replay_forced"}
    change_form_template = "admin/django_dbqueue/archivedmessage/change_form.html"
    fields = [
        ("id", "message_id", "queue", "kind", "key"),
        ("outcome", "priority", "attempts", "max_attempts"),
        ("created_at", "first_available_at", "claimed_at", "finished_at", "expires_at"),
        ("finished_by", "replay_of"),
        ("replayed_at", "replayed_by", "replayed"),
        "payload_pretty",
        "headers_pretty",
        "result_pretty",
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

    def _replay(self, request: HttpRequest, queryset: QuerySet, force: bool) -> None:
        by = request.user.get_username()
        replayed = self.apply(
            request, queryset, lambda row: control.replay(row, by=by, force=force), "replayed", "Not replayed"
        )
        if len(replayed) == 1:
            url = reverse("admin:django_dbqueue_message_change", args=[replayed[0].pk])
            self.message_user(request, format_html('New message: <a href="{}">{}</a>.', url, replayed[0].pk))

    @admin.action(description="Replay selected (new ready messages, attempts reset)", permissions=["replay"])
    def replay(self, request: HttpRequest, queryset: QuerySet) -> None:
        self._replay(request, queryset, force=False)

    @admin.action(description="Replay selected again, even if replayed before", permissions=["replay"])
    def replay_forced(self, request: HttpRequest, queryset: QuerySet) -> None:
        self._replay(request, queryset, force=True)

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: Any = None):
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

    list_display = ["id", "message_id", "queue", "kind", "key", "attempts", "error", "finished_at", "replayed"]
    list_filter = [QueueFilter, KindFilter, "finished_at"]
    actions = ["replay", "replay_forced", "purge"]
    object_actions = {"replay": "replay", "replay-forced": "replay_forced", "purge": "purge"}

    @admin.display(description="error")
    def error(self, obj: DeadLetter) -> str:
        lines = obj.last_error.strip().splitlines()
        return lines[-1][:120] if lines else ""

    @admin.action(description="Purge selected dead letters (delete for good)", permissions=["purge"])
    def purge(self, request: HttpRequest, queryset: QuerySet) -> None:
        purged = control.purge(queryset.values_list("pk", flat=True), using=queryset.db)
        self.message_user(request, f"{purged} dead letter(s) purged.", messages.SUCCESS)

    def get_urls(self) -> list:
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
                    url = reverse("admin:django_dbqueue_message_change", args=[new.pk])
                    self.message_user(request, format_html('Replayed as message <a href="{}">{}</a>.', url, new.pk))
                    return HttpResponseRedirect(reverse("admin:django_dbqueue_deadletter_change", args=[row.pk]))
        else:
            form = EditAndReplayForm(initial={"payload": json.dumps(row.payload, indent=2, ensure_ascii=False)})
        context = {
            **self.admin_site.each_context(request),
            "title": f"Edit and replay {row}",
            "opts": self.opts,
            "original": row,
            "form": form,
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


# --- the queues' overview --------------------------------------------------------


class PauseForm(forms.Form):
    queue = forms.CharField(max_length=64)
    paused = forms.TypedChoiceField(choices=[("1", "pause"), ("0", "resume")], coerce=lambda value: value == "1")


@admin.register(QueueState)
class QueueOverviewAdmin(NoEditForms, admin.ModelAdmin):
    """The "Queues" entry of the admin index: its list page is the overview, with pause and resume."""

    def has_pause_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(PERMISSIONS["pause"])

    def get_urls(self) -> list:
        return [
            path(
                "pause/",
                self.admin_site.admin_view(require_POST(self.pause_view)),
                name="django_dbqueue_queuestate_pause",
            ),
            *super().get_urls(),
        ]

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        overview = build_overview()
        rows = [
            {
                "queue": q,
                "oldest": format_age(q.oldest_ready_age),
                "chart": hourly_bars(
                    overview.hours,
                    [Series("acked", "#3a7d44", q.acked_per_hour), Series("dead", "#ba2121", q.dead_per_hour)],
                    title=f"{q.name}: acked and dead per hour, last 24 hours",
                ),
            }
            for q in overview.queues
        ]
        workers = [{"worker": w, "silent": format_age(w.silent_for)} for w in overview.workers]
        context = {
            **self.admin_site.each_context(request),
            "title": "Queues",
            "opts": self.opts,
            "overview": overview,
            "rows": rows,
            "workers": workers,
            "can_pause": self.has_pause_permission(request),
            "dead_letters_url": reverse("admin:django_dbqueue_deadletter_changelist"),
            "messages_url": reverse("admin:django_dbqueue_message_changelist"),
            **(extra_context or {}),
        }
        return TemplateResponse(request, "admin/django_dbqueue/overview.html", context)

    def pause_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_pause_permission(request):
            raise PermissionDenied
        form = PauseForm(request.POST)
        if not form.is_valid():
            self.message_user(request, f"Not changed: {form.errors.as_text()}", messages.ERROR)
        else:
            queue, paused = form.cleaned_data["queue"], form.cleaned_data["paused"]
            try:
                control.set_paused(
                    queue, paused, by=request.user.get_username(), using=get_settings().defaults.database
                )
            except DbQueueError as exc:
                self.message_user(request, f"Not changed: {exc}", messages.ERROR)
            else:
                self.message_user(request, f"Queue {queue} {'paused' if paused else 'resumed'}.", messages.SUCCESS)
        return HttpResponseRedirect(reverse("admin:django_dbqueue_queuestate_changelist"))


# --- topic subscriptions -----------------------------------------------------------


@admin.register(Subscription)
class SubscriptionAdmin(admin.ModelAdmin):
    """Subscriptions in the table; those of the ``TOPICS`` setting are changed in settings only."""

    list_display = ["topic", "queue", "also_in_settings", "created_at"]
    list_filter = ["topic"]
    search_fields = ["topic", "queue"]
    ordering = ["topic", "queue"]

    @admin.display(boolean=True, description="also in TOPICS setting")
    def also_in_settings(self, obj: Subscription) -> bool:
        return obj.queue in get_settings().topics.get(obj.topic, [])


# --- analytics -------------------------------------------------------------------


@admin.register(QueueStat)
class QueueStatAdmin(admin.ModelAdmin):
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
