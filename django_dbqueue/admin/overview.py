"""The "Queues" entry of the admin: the queues' overview page (figures from django_dbqueue.overview), pause, resume."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.views.decorators.http import require_POST

from .. import control
from ..conf import database_for
from ..exceptions import DbQueueError
from ..models import QueueState
from ..overview import Overview, build_overview, format_age
from .base import ModelAdmin, NoEditForms, OperatorPermissions, breadcrumbs, progress_bar
from .charts import Series, hourly_bars


class PauseForm(forms.Form):
    queue = forms.CharField(max_length=64)
    paused = forms.TypedChoiceField(choices=[("1", "pause"), ("0", "resume")], coerce=lambda value: value == "1")


def overview_rows(overview: Overview) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The page's queue rows (with their charts) and worker rows, formatted for the template."""
    queues = [
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
    return queues, workers


def running_rows(overview: Overview) -> list[dict[str, Any]]:
    """The in-flight messages that report progress, each with its bar and a link to its page."""
    return [
        {
            "message": r,
            "url": reverse("admin:django_dbqueue_message_change", args=[r.id]),
            "bar": progress_bar(
                {"done": r.done, "total": r.total, "note": r.note}, cancel_requested=r.cancel_requested
            ),
            "running_for": format_age(r.running_for),
        }
        for r in overview.running
    ]


@admin.register(QueueState)
class QueueOverviewAdmin(NoEditForms, OperatorPermissions, ModelAdmin[QueueState]):
    """The "Queues" entry of the admin index: its list page is the overview, with pause and resume."""

    def get_urls(self) -> list[URLPattern]:
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
        rows, workers = overview_rows(overview)
        context = {
            **self.admin_site.each_context(request),
            "title": "Queues",
            "opts": self.opts,
            **breadcrumbs(self.opts, ("Queues", None)),
            "overview": overview,
            "rows": rows,
            "workers": workers,
            "running": running_rows(overview),
            "flow": overview.flow,
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
                # On the database the queue lives on: where its workers read the switch.
                control.set_paused(queue, paused, by=request.user.get_username(), using=database_for(queue))
            except DbQueueError as exc:
                self.message_user(request, f"Not changed: {exc}", messages.ERROR)
            else:
                self.message_user(request, f"Queue {queue} {'paused' if paused else 'resumed'}.", messages.SUCCESS)
        return HttpResponseRedirect(reverse("admin:django_dbqueue_queuestate_changelist"))
