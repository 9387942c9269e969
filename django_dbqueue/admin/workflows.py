"""The workflows' admin: the list by state, outcome and name; a page per workflow with its graph; cancel, replay.

Cancel runs `Workflow.cancel` (permission ``cancel_workflowrun``); "replay
dead steps" replays the dead letters of the workflow's dead steps, as the
dead-letter admin does (permission ``replay_archivedmessage``), and the
workflow goes on from them (docs/workflows.md). Both are list actions and
buttons of a workflow's page.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.views.decorators.http import require_POST

from .. import control
from ..exceptions import DbQueueError
from ..models import ArchivedMessage, Outcome, WorkflowRun
from ..models.workflows import StepState, WorkflowEdge, WorkflowStep
from ..paginator import EstimatingPaginator
from ..workflows import Workflow
from .base import PERMISSIONS, NoEditForms, RefusedActions, flat, listed, shown
from .filters import ValuesFilter
from .graphs import Node, workflow_svg

# The most steps the detail page's table lists (the graph has its own bound).
MAX_LISTED = 500
# What the page shows of a step.
STEP_COLUMNS = ("id", "workflow_id", "name", "position", "queue", "state", "reason", "message_id")
CANCEL_PERMISSION = "django_dbqueue.cancel_workflowrun"


class NameFilter(ValuesFilter):
    title = parameter_name = field = "name"

    def known_values(self) -> set[str]:
        return WorkflowRun.objects.names()


class StateFilter(admin.SimpleListFilter):
    title = parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(WorkflowRun.RUNNING, "running"), (WorkflowRun.FINISHED, "finished")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[WorkflowRun]) -> QuerySet[WorkflowRun]:
        return queryset if self.value() is None else queryset.filter(state=self.value())


@admin.register(WorkflowRun)
class WorkflowRunAdmin(NoEditForms, RefusedActions[WorkflowRun]):
    list_display = ["id", "name_shown", "state", "outcome", "open_steps", "failed_steps", "created_at", "finished_at"]
    list_filter = [StateFilter, "outcome", NameFilter, "created_at"]
    search_fields = ["=name"]
    search_help_text = "An exact workflow name."
    ordering = ["-id"]
    paginator = EstimatingPaginator
    show_full_result_count = False
    list_per_page = 50
    actions = ["cancel", "replay_dead_steps"]
    # The page's buttons: URL name -> the list action it runs on that one workflow.
    object_actions = {"cancel": "cancel", "replay-dead-steps": "replay_dead_steps"}
    change_form_template = "admin/django_dbqueue/workflowrun/change_form.html"
    action_limit = 100
    fields = [
        ("id", "name_shown", "state", "outcome"),
        ("open_steps", "failed_steps", "created_at", "finished_at"),
        "policy",
        "graph",
        "steps_table",
    ]
    readonly_fields = flat(fields)

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(CANCEL_PERMISSION)

    def has_replay_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(PERMISSIONS["replay"])

    @admin.display(description="name", ordering="name")
    def name_shown(self, obj: WorkflowRun) -> str:
        return shown(obj.name)

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[WorkflowRun], search_term: str
    ) -> tuple[QuerySet[WorkflowRun], bool]:
        """An exact name, compared as names are (byte for byte), by the (name, created_at) index.

        Django's ``=name`` is ``iexact``: on MySQL/MariaDB a case-insensitive
        collation that cannot use the index, so every search read the table.
        """
        term = search_term.strip()
        return (queryset.filter(name=term) if term else queryset), False

    def steps_of(self, obj: WorkflowRun) -> list[WorkflowStep]:
        """The steps' columns the page shows, read once per page (the graph and the table share them).

        Not their payloads, options and results: JSON of up to 64 KiB each,
        which a 1,000-step workflow's page spent most of its time decoding.
        """
        cached: list[WorkflowStep] | None = getattr(obj, "_dbqueue_steps", None)
        if cached is None:
            steps = WorkflowStep.objects.using(obj._state.db).filter(workflow_id=obj.pk).order_by("position")
            cached = list(steps.only(*STEP_COLUMNS))
            obj._dbqueue_steps = cached  # type: ignore[attr-defined]  # a page-long cache on the row itself
        return cached

    @admin.display(description="graph")
    def graph(self, obj: WorkflowRun) -> SafeString:
        steps = self.steps_of(obj)
        edges = WorkflowEdge.objects.using(obj._state.db).filter(workflow_id=obj.pk).values_list("parent", "child")
        return workflow_svg([Node(s.name, s.state) for s in steps], list(edges))

    @admin.display(description="steps")
    def steps_table(self, obj: WorkflowRun) -> SafeString:
        steps = self.steps_of(obj)
        rows = [
            (shown(s.name), s.state, s.state, shown(s.queue), shown(s.reason) or "-", self.step_link(s))
            for s in steps[:MAX_LISTED]
        ]
        more = (
            format_html("<p>{} more step(s) not listed.</p>", len(steps) - MAX_LISTED)
            if len(steps) > MAX_LISTED
            else ""
        )
        return format_html(
            '<table class="dbqueue-steps"><thead><tr><th>step</th><th>state</th><th>queue</th><th>reason</th>'
            "<th>message</th></tr></thead><tbody>{}</tbody></table>{}",
            format_html_join(
                "",
                '<tr><td>{}</td><td class="dbqueue-step-{}">{}</td><td>{}</td><td>{}</td><td>{}</td></tr>',
                rows,
            ),
            more,
        )

    @staticmethod
    def step_link(step: WorkflowStep) -> SafeString | str:
        """Its live message's page while enqueued; its archive rows once finished; "-" before it has a message."""
        if step.message_id is None:
            return "-"
        if step.state == StepState.ENQUEUED:
            url = reverse("admin:django_dbqueue_message_change", args=[step.message_id])
            return format_html('<a href="{}">message {}</a>', url, step.message_id)
        url = f"{reverse('admin:django_dbqueue_archivedmessage_changelist')}?message_id={step.message_id}"
        return format_html('<a href="{}">archived message {}</a>', url, step.message_id)

    def selected(self, request: HttpRequest, queryset: QuerySet[WorkflowRun]) -> list[WorkflowRun]:
        rows = list(queryset[: self.action_limit + 1])
        if len(rows) > self.action_limit:
            self.message_user(
                request,
                f"Only the first {self.action_limit} selected workflows were handled; "
                "narrow the list with its filters to reach the rest.",
                messages.WARNING,
            )
        return rows[: self.action_limit]

    @admin.action(
        description="Cancel selected workflows (running steps: their worker stops them)", permissions=["cancel"]
    )
    def cancel(self, request: HttpRequest, queryset: QuerySet[WorkflowRun]) -> None:
        by = request.user.get_username()
        done, skipped = [], []
        for run in self.selected(request, queryset):
            if run.state == WorkflowRun.FINISHED:
                skipped.append(str(run.pk))
                continue
            Workflow.cancel(run.pk, by=by, using=queryset.db)
            done.append(str(run.pk))
        if done:
            self.message_user(request, f"{len(done)} workflow(s) cancelled: {listed(done)}.", messages.SUCCESS)
        if skipped:
            self.message_user(request, f"Finished already, left alone: {listed(skipped)}.", messages.WARNING)

    @admin.action(
        description="Replay the dead steps of selected workflows (they go on from there)", permissions=["replay"]
    )
    def replay_dead_steps(self, request: HttpRequest, queryset: QuerySet[WorkflowRun]) -> None:
        by = request.user.get_username()
        replayed, refused = [], []
        for run in self.selected(request, queryset):
            ids = WorkflowStep.objects.using(queryset.db).filter(workflow_id=run.pk, state=StepState.DEAD)
            rows = ArchivedMessage.objects.using(queryset.db).filter(
                message_id__in=ids.values_list("message_id", flat=True), outcome=Outcome.DEAD
            )
            for row in rows.order_by("id"):
                try:
                    control.replay(row, by=by)
                except DbQueueError as exc:
                    refused.append(f"message {row.message_id}: {exc}")
                else:
                    replayed.append(str(row.message_id))
        if replayed:
            self.message_user(request, f"{len(replayed)} dead step(s) replayed: messages {listed(replayed)}.")
        if refused:
            self.message_user(request, f"Not replayed: {listed(refused)}.", messages.ERROR)
        if not replayed and not refused:
            self.message_user(request, "No dead steps in the selected workflows.", messages.WARNING)

    # --- the page's buttons: the list's actions on one workflow ----------------------------

    def get_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view(require_POST(self.object_action))
        return [
            path("<path:object_id>/do/<str:name>/", view, name="django_dbqueue_workflowrun_do"),
            *super().get_urls(),
        ]

    def object_action(self, request: HttpRequest, object_id: str, name: str) -> HttpResponse:
        """A button's POST: 403 without the view permission or the action's own, 404 for an unknown one."""
        if name not in self.object_actions:
            raise Http404(f"no action {name!r}")
        action = getattr(self, self.object_actions[name])
        allowed = [getattr(self, f"has_{p}_permission")(request) for p in action.allowed_permissions]
        if not (self.has_view_permission(request) and all(allowed)):
            raise PermissionDenied
        run = self.get_object(request, object_id)
        if run is None:
            raise Http404(f"no workflow with id {object_id!r}")
        action(request, self.get_queryset(request).filter(pk=run.pk))
        return HttpResponseRedirect(reverse("admin:django_dbqueue_workflowrun_change", args=[run.pk]))

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        extra = {
            "can_cancel": self.has_cancel_permission(request),
            "can_replay": self.has_replay_permission(request),
            **(extra_context or {}),
        }
        return super().change_view(request, object_id, form_url, extra)
